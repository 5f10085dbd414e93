"""Segment files: a generation's chunk index is a list of immutable segments (see store.vectors
for the index over them). A segment holds a set of chunk ids twice over:

- their vectors, a FAISS file (`segments/seg-*.faiss`): a small segment is exact,
  `IndexIDMap2(IndexFlatIP)`; a large one (at least IVF_MIN vectors) is an inverted file,
  `IndexIVFFlat`, whose `nprobe` is tuned when it is built for recall@10 >= RECALL_TARGET
  against exact search on queries near its own vectors, and recorded in the manifest;
- their words, a lexical file (`segments/terms-*.safetensors`, store.lexical): the postings
  BM25 searches. A segment written by a ragkv before the lexical index has none; the next
  writer builds it from the chunks' text (once).

Every file name is unique (a uuid in it), so a copy of one (an S3 mirror's) is never stale,
and a rebuilt file gets a new name.
"""

from __future__ import annotations

import os
import threading
import uuid
import weakref
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import faiss
import numpy as np

from ragkv.errors import StoreCorruptError
from store.generations import SEGMENT_DIR
from store.lexical import ANALYSER, Postings, load_postings

IVF_MIN = 50_000  # a segment with fewer vectors is searched exactly
RECALL_TARGET = 0.95
_NPROBES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
_TUNE_QUERIES = 200


@dataclass(frozen=True)
class SegmentInfo:
    """One segment file as the generation manifest records it."""

    name: str
    kind: str  # "flat" | "ivf"
    count: int
    nbytes: int
    nlist: int = 0
    nprobe: int = 0
    recall: float = 1.0  # recall@10 measured when the segment was built (flat: exact)
    terms: str = ""  # its lexical file ("": none, a segment written before the lexical index)
    terms_nbytes: int = 0
    analyser: str = ""  # what split its lexical file's words (store.lexical.ANALYSER when current)

    @property
    def has_terms(self) -> bool:
        """Whether it has a lexical file of the current analyser (else the next writer builds one)."""
        return bool(self.terms) and self.analyser == ANALYSER

    def files(self) -> list[str]:
        """Its files' names in the segment folder."""
        return [self.name, self.terms] if self.terms else [self.name]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> SegmentInfo:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


class Segment:
    """A loaded segment (shared by every snapshot of this process that lists it): its vectors
    at once, its postings on first use (`postings`)."""

    def __init__(self, info: SegmentInfo, index: faiss.Index, folder: Path | None = None):
        self.info = info
        self.index = index
        self.folder = folder
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
            self._ids = segment_ids(self.index)
        return self._ids

    def search(self, query: np.ndarray, k: int, selector=None, filtered: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """(scores, ids), each `(1, <= k)`. `filtered` (the selector admits only some ids): an
        IVF segment whose probed lists hold fewer than `k` admitted ids is searched again over
        every list, so a filter never shrinks top-k to what the nearest lists happen to hold."""
        nprobe = self.info.nprobe if self.info.kind == "ivf" else 0
        scores, ids = search_index(self.index, query, k, selector, nprobe)
        if filtered and nprobe and (ids[0] >= 0).sum() < k:
            scores, ids = search_index(self.index, query, k, selector, self.info.nlist)
        return scores, ids


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
    key = (str(path.resolve()), stat.st_ino, stat.st_size)
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
    segment = Segment(info, index, folder)
    with _loaded_lock:
        _loaded[key + (info.terms,)] = segment
    return segment


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
    """(ids, vectors) of every vector an index holds (both kinds store them uncompressed)."""
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


def build_segment(
    folder: Path,
    ids: np.ndarray,
    vectors: np.ndarray,
    postings: Postings | None,
    tag: str,
    ivf: bool | None = None,
    seed: int = 0,
) -> SegmentInfo:
    """Write `vectors` (normalised float32) under `ids` as a new segment, with `postings` (the
    same ids' words) as its lexical file; an IVF segment when there are at least IVF_MIN
    vectors (or `ivf`), its nprobe tuned here."""
    dim = vectors.shape[1]
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    use_ivf = len(ids) >= IVF_MIN if ivf is None else ivf
    nlist = nprobe = 0
    recall = 1.0
    if use_ivf:
        nlist = ivf_lists(len(ids))
        quantizer = faiss.IndexFlatIP(dim)
        index = faiss.IndexIVFFlat(quantizer, dim, nlist, faiss.METRIC_INNER_PRODUCT)
        rng = np.random.default_rng(seed)
        sample = vectors[rng.choice(len(vectors), min(len(vectors), 40 * nlist), replace=False)]
        index.cp.seed = seed
        index.train(sample)
        index.add_with_ids(vectors, ids)
        index.own_fields = True
        quantizer.this.disown()
        nprobe, recall = tune_nprobe(index, ids, vectors, rng)
    else:
        index = faiss.IndexIDMap2(faiss.IndexFlatIP(dim))
        index.add_with_ids(vectors, ids)
    folder.mkdir(parents=True, exist_ok=True)
    name = f"seg-{tag}-{uuid.uuid4().hex[:8]}.faiss"
    path = folder / name
    tmp = path.with_name(f".{name}.tmp")
    faiss.write_index(index, str(tmp))
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    info = SegmentInfo(name, "ivf" if use_ivf else "flat", len(ids), path.stat().st_size, nlist, nprobe, recall)
    return with_terms(folder, info, postings, tag) if postings is not None else info


def with_terms(folder: Path, info: SegmentInfo, postings: Postings, tag: str) -> SegmentInfo:
    """`info` with `postings` written as its (new) lexical file."""
    if len(postings.chunk_ids) != info.count:
        raise AssertionError(f"postings for {len(postings.chunk_ids)} chunks beside {info.count} vectors")
    name = f"terms-{tag}-{uuid.uuid4().hex[:8]}.safetensors"
    return replace(info, terms=name, terms_nbytes=postings.save(folder / name), analyser=ANALYSER)


def ivf_lists(n: int) -> int:
    """Inverted lists for `n` vectors: about sqrt(n), at least 64."""
    return int(max(64, min(65536, round(np.sqrt(n)))))


def tune_nprobe(index: faiss.IndexIVF, ids: np.ndarray, vectors: np.ndarray, rng) -> tuple[int, float]:
    """The smallest nprobe whose recall@10 against exact search reaches RECALL_TARGET, on
    queries near stored vectors (a stored vector plus noise, renormalised: the query is not
    one of the vectors). Returns (nprobe, the recall measured)."""
    picks = rng.choice(len(vectors), min(_TUNE_QUERIES, len(vectors)), replace=False)
    noise = rng.standard_normal((len(picks), vectors.shape[1])).astype(np.float32)
    noise /= np.linalg.norm(noise, axis=1, keepdims=True)
    queries = vectors[picks] + 0.7 * noise
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    exact = faiss.IndexFlatIP(vectors.shape[1])
    exact.add(vectors)
    _, rows = exact.search(queries, 10)
    truth = ids[rows]
    for nprobe in _NPROBES:
        if nprobe >= index.nlist:
            break
        _, found = index.search(queries, 10, params=faiss.SearchParametersIVF(nprobe=nprobe))
        if (recall := recall_at(found, truth)) >= RECALL_TARGET:
            return nprobe, recall
    return index.nlist, 1.0


def recall_at(found: np.ndarray, truth: np.ndarray) -> float:
    """The share of the ids in `truth`'s rows that the same rows of `found` hold."""
    hits = total = 0
    for got, want in zip(found, truth, strict=False):
        want = want[want >= 0]
        hits += len(set(got.tolist()) & set(want.tolist()))
        total += len(want)
    return hits / max(total, 1)
