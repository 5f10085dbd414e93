"""Segment files: a generation's chunk index is a list of immutable segments (see ragkv.store.index.vectors
for the index over them). A segment holds a set of chunk ids twice over:

- their vectors, a FAISS file (`segments/seg-*.faiss`): a small segment is exact,
  `IndexIDMap2(IndexFlatIP)`; a large one (at least IVF_MIN vectors, ragkv.store.index.build) is an inverted file of
  product-quantised codes, `IndexIVFPQ` (kind "ivfpq": 8 dimensions to a byte, 48 bytes for a
  384-dim vector against 1,536 in float32), beside its vectors in float32 sorted by id
  (`segments/vec-*.npy`), which a reader never loads: a search takes the RESCORE best
  candidates by their codes and re-scores them exactly, reading their rows from that file
  (`DiskVectors`: a `pread` per row, so the file is the kernel's page cache, never the
  process's memory; a memory map faulted the whole file in within 200 searches). Its
  `nprobe` is tuned when it is built, through the re-score, for recall@10 >= RECALL_TARGET
  against exact search on queries near its own vectors, and recorded in the manifest. A store
  of an earlier ragkv may hold kind "ivf", `IndexIVFFlat` (float32 vectors in its lists, all
  in memory): read as it is, rewritten as "ivfpq" by the next compaction;
- their words, a lexical file (`segments/terms-*.safetensors`, ragkv.store.index.lexical): the postings
  BM25 searches. A segment written by a ragkv before the lexical index has none; the next
  writer builds it from the chunks' text (once).

Every file name is unique (a uuid in it), so a copy of one (an S3 mirror's) is never stale,
and a rebuilt file gets a new name.
"""

from __future__ import annotations

import os
import threading
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path

import faiss
import numpy as np

from ragkv.core.errors import StoreCorruptError
from ragkv.store.generations import SEGMENT_DIR
from ragkv.store.index.lexical import ANALYSER, Postings, load_postings

RESCORE = 100  # candidates an "ivfpq" search re-scores exactly (at least 4 k), unless tuning asked more


@dataclass(frozen=True)
class SegmentInfo:
    """One segment file as the generation manifest records it."""

    name: str
    kind: str  # "flat" | "ivfpq" | "ivf" (written by an earlier ragkv)
    count: int
    nbytes: int
    nlist: int = 0
    nprobe: int = 0
    recall: float = 1.0  # recall@10 measured when the segment was built (flat: exact)
    terms: str = ""  # its lexical file ("": none, a segment written before the lexical index)
    terms_nbytes: int = 0
    analyser: str = ""  # what split its lexical file's words (ragkv.store.index.lexical.ANALYSER when current)
    vectors: str = ""  # "ivfpq": its float32 vectors sorted by id, for the re-score
    vectors_nbytes: int = 0
    pq_bytes: int = 0  # "ivfpq": bytes of one vector's code
    rescore: int = 0  # "ivfpq": candidates a search re-scores (tuned with nprobe)

    @property
    def has_terms(self) -> bool:
        """Whether it has a lexical file of the current analyser (else the next writer builds one)."""
        return bool(self.terms) and self.analyser == ANALYSER

    def files(self) -> list[str]:
        """Its files' names in the segment folder."""
        return [name for name in (self.name, self.terms, self.vectors) if name]

    def ram_bytes(self, dim: int) -> int:
        """What a reader holds in memory for its vectors once loaded (FAISS's lists, its
        centroids, and for "ivfpq" its codebooks and the sorted ids of the re-score; the vectors
        file stays on disk)."""
        centroids = self.nlist * dim * 4
        if self.kind == "ivfpq":
            return self.count * (self.pq_bytes + 8 + 8) + centroids + 256 * dim * 4
        return self.count * (dim * 4 + 8) + centroids

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> SegmentInfo:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


class Segment:
    """A loaded segment (shared by every snapshot of this process that lists it): its vectors
    at once, its postings on first use (`postings`)."""

    def __init__(
        self,
        info: SegmentInfo,
        index: faiss.Index,
        folder: Path | None = None,
        exact: tuple[np.ndarray, DiskVectors] | None = None,
    ):
        self.info = info
        self.index = index
        self.folder = folder
        self.exact = exact  # "ivfpq": (ids ascending, their float32 vectors on disk)
        self._ids: np.ndarray | None = None
        self._postings: Postings | None = None
        self._lock = threading.Lock()

    def postings(self) -> Postings | None:
        """Its lexical part (None: it has none of the current analyser); StoreCorruptError naming
        a damaged file."""
        if not self.info.has_terms:
            return None
        with self._lock:
            if self._postings is None:
                assert self.folder is not None  # a segment with a lexical file was loaded from its folder
                self._postings = load_postings(self.folder / self.info.terms, self.folder.parent, self.info.count)
            return self._postings

    def ids(self) -> np.ndarray:
        if self._ids is None:
            self._ids = self.exact[0] if self.exact is not None else segment_ids(self.index)
        return self._ids

    def vectors(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, float32 vectors) of everything it holds, in memory (for a merge or compaction)."""
        if self.exact is not None:
            return self.exact[0].copy(), self.exact[1].all()
        return segment_vectors(self.index)

    def search(self, query: np.ndarray, k: int, selector=None, filtered: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """(scores, ids), each `(1, <= k)`. `filtered` (the selector admits only some ids): an
        IVF segment whose probed lists hold fewer than `k` admitted ids is searched again over
        every list, so a filter never shrinks top-k to what the nearest lists happen to hold."""
        nprobe = self.info.nprobe if self.info.kind != "flat" else 0
        scores, ids = self._search(query, k, selector, nprobe)
        if filtered and nprobe and (ids[0] >= 0).sum() < k:
            scores, ids = self._search(query, k, selector, self.info.nlist)
        return scores, ids

    def _search(self, query: np.ndarray, k: int, selector, nprobe: int) -> tuple[np.ndarray, np.ndarray]:
        if self.exact is None:
            return search_index(self.index, query, k, selector, nprobe)
        _, candidates = search_index(self.index, query, max(self.info.rescore, 4 * k), selector, nprobe)
        return rescore(self.exact, query, candidates, k)


class DiskVectors:
    """Float32 vectors in a `.npy` file, read a row at a time (`rows`) or whole (`all`)."""

    def __init__(self, path: Path):
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, fortran, dtype = header(f)
            self.offset = f.tell()
        if fortran or dtype != np.float32 or len(shape) != 2:
            raise ValueError(f"holds {shape} {dtype}, not rows of float32")
        self.path, self.shape = path, shape
        self.fd = os.open(path, os.O_RDONLY)
        self._finalizer = weakref.finalize(self, os.close, self.fd)
        if os.fstat(self.fd).st_size != self.offset + shape[0] * shape[1] * 4:
            raise ValueError("truncated")

    def rows(self, indices: np.ndarray) -> np.ndarray:
        """Rows `indices` `(n,)`, `(n, dim)`."""
        dim = self.shape[1]
        out = np.empty((len(indices), dim), np.float32)
        for i, row in enumerate(indices.tolist()):
            if os.preadv(self.fd, [out[i]], self.offset + row * dim * 4) != dim * 4:
                raise StoreCorruptError(f"the vectors file {SEGMENT_DIR}/{self.path.name} is truncated")
        return out

    def all(self) -> np.ndarray:
        return np.load(self.path)


def rescore(
    exact: tuple[np.ndarray, np.ndarray | DiskVectors], query: np.ndarray, candidates: np.ndarray, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """The `k` best of `candidates` `(1, n)` (-1: none) by their exact inner product with `query`
    `(1, dim)`, from `exact` (ids ascending, their vectors: in memory, or on disk), as (scores,
    ids) `(1, <= k)`."""
    found = np.sort(candidates[0][candidates[0] >= 0])
    ids, vectors = exact
    rows = np.searchsorted(ids, found)
    scores = (vectors.rows(rows) if isinstance(vectors, DiskVectors) else vectors[rows]) @ query[0]
    best = np.argsort(-scores, kind="stable")[:k]
    return scores[best][None].astype(np.float32), found[best][None]


def search_index(
    index: faiss.Index, query: np.ndarray, k: int, selector=None, nprobe: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """(scores, ids), each `(1, <= k)`, of `query` `(1, dim)` in `index`; only ids `selector`
    admits when given; `nprobe` lists of an IVF index (0: a flat one)."""
    k = min(k, index.ntotal)
    if k < 1:
        return np.empty((1, 0), np.float32), np.empty((1, 0), np.int64)
    params = faiss.SearchParametersIVF(nprobe=nprobe) if nprobe else faiss.SearchParameters()
    if selector is not None:
        params.sel = selector
    return index.search(query, k, params=params)


def open_flat_file(path: Path, name: str, store: Path) -> Segment:
    """A format-1 store's one index file (flat, with an id map) as a segment named `name`."""
    index = read_index(path, store)
    return Segment(SegmentInfo(name, "flat", index.ntotal, path.stat().st_size), index)


_loaded: weakref.WeakValueDictionary[tuple, Segment] = weakref.WeakValueDictionary()
_loaded_lock = threading.Lock()


def load_segment(folder: Path, info: SegmentInfo) -> Segment:
    """The segment `info` names in `folder`; StoreCorruptError if it cannot be read or does not
    hold what the manifest says. Loaded once per process while anything holds it: segment files
    never change, so a reader moving to a new generation reuses what it already has."""
    path = folder / info.name
    try:
        stat = path.stat()
    except FileNotFoundError:
        raise StoreCorruptError(
            f"the vector segment {SEGMENT_DIR}/{info.name} is missing; rebuild the index with: "
            f"ragkv verify --repair --store {folder.parent}"
        ) from None
    key = (str(path.resolve()), stat.st_ino, stat.st_size, *_identity(folder / info.vectors if info.vectors else None))
    with _loaded_lock:  # keyed by its lexical file too: a segment given one later is a new Segment
        if (segment := _loaded.get(key + (info.terms,))) is not None:
            return segment
    if stat.st_size != info.nbytes:
        raise StoreCorruptError(
            f"the vector segment {SEGMENT_DIR}/{info.name} is damaged (truncated: {stat.st_size} "
            f"of {info.nbytes} bytes); rebuild it with: ragkv verify --repair --store {folder.parent}"
        )
    index = read_index(path, folder.parent)
    if index.ntotal != info.count:
        raise StoreCorruptError(
            f"the vector segment {SEGMENT_DIR}/{info.name} is damaged (holds {index.ntotal} vectors, "
            f"not {info.count}); rebuild it with: ragkv verify --repair --store {folder.parent}"
        )
    segment = Segment(info, index, folder, _exact_vectors(folder, info, index) if info.kind == "ivfpq" else None)
    with _loaded_lock:
        _loaded[key + (info.terms,)] = segment
    return segment


def _identity(path: Path | None) -> tuple:
    """What tells a file apart from another of its name (none: ())."""
    if path is None:
        return ()
    try:
        stat = path.stat()
    except FileNotFoundError:
        return ("missing",)
    return (stat.st_ino, stat.st_size)


def _exact_vectors(folder: Path, info: SegmentInfo, index: faiss.Index) -> tuple[np.ndarray, DiskVectors]:
    """An "ivfpq" segment's re-score table: its ids ascending and its vectors file (the same
    order, read from disk); StoreCorruptError when the file is missing or does not fit the segment."""
    path, damaged = folder / info.vectors, None
    try:
        if path.stat().st_size != info.vectors_nbytes:
            damaged = f"{path.stat().st_size} of {info.vectors_nbytes} bytes"
        else:
            vectors = DiskVectors(path)
            if vectors.shape != (info.count, index.d):
                damaged = f"holds {vectors.shape} vectors"
    except FileNotFoundError:
        damaged = "missing"
    except ValueError as exc:
        damaged = str(exc).splitlines()[0][:120]
    if damaged is not None:
        raise StoreCorruptError(
            f"the vectors file {SEGMENT_DIR}/{info.vectors} is damaged ({damaged}); rebuild the index with: "
            f"ragkv verify --repair --store {folder.parent}"
        )
    return np.sort(segment_ids(index)), vectors


def read_index(path: Path, store: Path) -> faiss.Index:
    try:
        return faiss.read_index(str(path))
    except RuntimeError as exc:  # FAISS reports every read failure so
        # FAISS says "Error in <function> at <file:line>: <what>"; a short read is a truncated file.
        message = str(exc).splitlines()[0] if str(exc) else ""
        reason = "truncated" if "read error" in message else message.rpartition(": ")[2][:120] or "unreadable"
        raise StoreCorruptError(
            f"the vector index {path.name} is damaged ({reason}); rebuild it with: "
            f"ragkv verify --repair --store {store}"
        ) from None


def segment_ids(index: faiss.Index) -> np.ndarray:
    """Every id a flat-with-id-map or IVF index holds."""
    if isinstance(index, faiss.IndexIDMap):
        return faiss.vector_to_array(index.id_map).astype(np.int64)
    ivf = faiss.extract_index_ivf(index)
    lists = ivf.invlists
    parts = [
        faiss.rev_swig_ptr(lists.get_ids(i), lists.list_size(i)).copy() for i in range(ivf.nlist) if lists.list_size(i)
    ]
    return np.concatenate(parts).astype(np.int64) if parts else np.empty(0, np.int64)


def segment_vectors(index: faiss.Index) -> tuple[np.ndarray, np.ndarray]:
    """(ids, vectors) of every vector a flat or IVF-flat index holds (they store them
    uncompressed; an "ivfpq" segment's are in its vectors file: `Segment.vectors`)."""
    if isinstance(index, faiss.IndexIDMap):
        ids = faiss.vector_to_array(index.id_map).astype(np.int64)
        flat = faiss.downcast_index(index.index)
        return ids, faiss.rev_swig_ptr(flat.get_xb(), flat.ntotal * flat.d).reshape(-1, flat.d).copy()
    ivf = faiss.extract_index_ivf(index)
    lists, ids, vectors = ivf.invlists, [], []
    for i in range(ivf.nlist):
        n = lists.list_size(i)
        if n:
            ids.append(faiss.rev_swig_ptr(lists.get_ids(i), n).copy())
            codes = faiss.rev_swig_ptr(lists.get_codes(i), n * lists.code_size).copy()
            vectors.append(codes.view(np.float32).reshape(n, ivf.d))
    if not ids:
        return np.empty(0, np.int64), np.empty((0, ivf.d), np.float32)
    return np.concatenate(ids).astype(np.int64), np.concatenate(vectors)
