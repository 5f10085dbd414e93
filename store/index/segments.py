"""Segment files: a generation's chunk index is a list of immutable segments (see ragkv.store.index.vectors
for the index over them). A segment holds a set of chunk ids twice over:

- their vectors, a FAISS file (`segments/seg-*.faiss`): a small segment is exact,
  `IndexIDMap2(IndexFlatIP)`; a large one (at least IVF_MIN vectors) is an inverted file of
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
import uuid
import weakref
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import faiss
import numpy as np

from ragkv.core.errors import StoreCorruptError
from ragkv.store.generations import SEGMENT_DIR
from ragkv.store.index.lexical import ANALYSER, Postings, load_postings

IVF_MIN = 50_000  # a segment with fewer vectors is searched exactly
RECALL_TARGET = 0.95
RESCORE = 100  # candidates an "ivfpq" search re-scores exactly (at least 4 k), unless tuning asked more
_RESCORES = (RESCORE, 200, 400, 800, 1600, 3200)
PQ_DIMS_PER_CODE = 8  # dimensions a one-byte PQ code stands for
_NPROBES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
_TUNE_QUERIES = 200


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
    same ids' words) as its lexical file; an "ivfpq" segment (and its vectors file) when there
    are at least IVF_MIN vectors (or `ivf`), its nprobe tuned here."""
    dim = vectors.shape[1]
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    use_ivf = len(ids) >= IVF_MIN if ivf is None else ivf
    folder.mkdir(parents=True, exist_ok=True)
    if use_ivf:
        info = _build_ivfpq(folder, ids, vectors, tag, seed)
    else:
        index = faiss.IndexIDMap2(faiss.IndexFlatIP(dim))
        index.add_with_ids(vectors, ids)
        name, nbytes = _write_new(folder, f"seg-{tag}", ".faiss", lambda path: faiss.write_index(index, str(path)))
        info = SegmentInfo(name, "flat", len(ids), nbytes)
    return with_terms(folder, info, postings, tag) if postings is not None else info


def _build_ivfpq(folder: Path, ids: np.ndarray, vectors: np.ndarray, tag: str, seed: int) -> SegmentInfo:
    """An "ivfpq" segment of `vectors` under `ids`: the coarse lists and the codes trained on a
    sample, the vectors file, and nprobe and the candidates tuned through the re-score."""
    rng = np.random.default_rng(seed)
    index = trained_ivfpq(vectors[rng.choice(len(vectors), training_rows(len(vectors)), replace=False)], len(ids), seed)
    index.add_with_ids(vectors, ids)
    order = np.argsort(ids, kind="stable")
    exact = (ids[order], vectors[order])
    nprobe, recall, candidates = tune_nprobe(index, *tuning_queries(ids, vectors, np.random.default_rng(seed)), exact)
    name, nbytes = _write_new(folder, f"seg-{tag}", ".faiss", lambda path: faiss.write_index(index, str(path)))
    vectors_name, vectors_nbytes = _write_new(folder, f"vec-{tag}", ".npy", lambda path: _save_npy(path, exact[1]))
    return SegmentInfo(
        name,
        "ivfpq",
        len(ids),
        nbytes,
        index.nlist,
        nprobe,
        recall,
        vectors=vectors_name,
        vectors_nbytes=vectors_nbytes,
        pq_bytes=index.code_size,
        rescore=candidates,
    )


def trained_ivfpq(sample: np.ndarray, count: int, seed: int = 0) -> faiss.IndexIVFPQ:
    """An empty "ivfpq" index for `count` vectors (ivf_lists(count) lists, codes of
    pq_codes(dim) bytes), trained on `sample` (`training_rows(count)` of them)."""
    dim = sample.shape[1]
    quantizer = faiss.IndexFlatIP(dim)
    index = faiss.IndexIVFPQ(quantizer, dim, ivf_lists(count), pq_codes(dim), 8, faiss.METRIC_INNER_PRODUCT)
    index.cp.seed = seed
    index.train(sample)
    index.own_fields = True
    quantizer.this.disown()
    return index


def training_rows(count: int) -> int:
    """Vectors an "ivfpq" index of `count` trains on: 40 per list, and at least 64 per code
    value (256 of them) for the codes."""
    return min(count, max(40 * ivf_lists(count), 64 * 256))


def _save_npy(path: Path, array: np.ndarray) -> None:
    with open(path, "wb") as f:
        np.save(f, array)


def _write_new(folder: Path, stem: str, suffix: str, write) -> tuple[str, int]:
    """A new uniquely named file `stem-<uuid>suffix` in `folder`, written by `write(path)` to a
    temporary name, synced, then renamed; returns (its name, its size)."""
    name = f"{stem}-{uuid.uuid4().hex[:8]}{suffix}"
    path = folder / name
    tmp = path.with_name(f".{name}.tmp")
    write(tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return name, path.stat().st_size


def pq_codes(dim: int) -> int:
    """Bytes of one vector's PQ code: one per PQ_DIMS_PER_CODE dimensions, a divisor of `dim`."""
    codes = max(1, dim // PQ_DIMS_PER_CODE)
    while dim % codes:
        codes -= 1
    return codes


def with_terms(folder: Path, info: SegmentInfo, postings: Postings, tag: str) -> SegmentInfo:
    """`info` with `postings` written as its (new) lexical file."""
    if len(postings.chunk_ids) != info.count:
        raise AssertionError(f"postings for {len(postings.chunk_ids)} chunks beside {info.count} vectors")
    name = f"terms-{tag}-{uuid.uuid4().hex[:8]}.safetensors"
    return replace(info, terms=name, terms_nbytes=postings.save(folder / name), analyser=ANALYSER)


def ivf_lists(n: int) -> int:
    """Inverted lists for `n` vectors: about sqrt(n), at least 64."""
    return int(max(64, min(65536, round(np.sqrt(n)))))


def tuning_queries(ids: np.ndarray, vectors: np.ndarray, rng) -> tuple[np.ndarray, np.ndarray]:
    """Queries near stored vectors (a stored vector plus noise, renormalised: the query is not
    one of the vectors) and their exact top-10 ids, `(Q, dim)` and `(Q, 10)`, to tune on."""
    picks = rng.choice(len(vectors), min(_TUNE_QUERIES, len(vectors)), replace=False)
    noise = rng.standard_normal((len(picks), vectors.shape[1])).astype(np.float32)
    noise /= np.linalg.norm(noise, axis=1, keepdims=True)
    queries = vectors[picks] + 0.7 * noise
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    flat = faiss.IndexFlatIP(vectors.shape[1])
    flat.add(vectors)
    _, rows = flat.search(queries, 10)
    return queries, ids[rows]


def tune_nprobe(
    index: faiss.IndexIVF,
    queries: np.ndarray,
    truth: np.ndarray,
    exact: tuple[np.ndarray, np.ndarray | DiskVectors] | None = None,
) -> tuple[int, float, int]:
    """The smallest nprobe whose recall@10 against `truth` (see `tuning_queries`) reaches
    RECALL_TARGET; with `exact` (an "ivfpq" segment's re-score table), through the re-score of
    the fewest candidates (_RESCORES) that reach it, raising nprobe at each only while recall
    still grows. Returns (nprobe, the recall measured, the candidates: 0 without `exact`); when
    nothing reaches the target, the last tried."""
    recall = 0.0
    for candidates in _RESCORES if exact is not None else (0,):
        previous = -1.0
        for nprobe in [n for n in _NPROBES if n < index.nlist] + [index.nlist]:
            params = faiss.SearchParametersIVF(nprobe=nprobe)
            if exact is None:
                _, found = index.search(queries, 10, params=params)
            else:
                _, near = index.search(queries, candidates, params=params)
                found = np.array(
                    [
                        np.pad(rescore(exact, q[None], c[None], 10)[1][0], (0, 10), constant_values=-1)[:10]
                        for q, c in zip(queries, near, strict=True)
                    ]
                )
            if (recall := recall_at(found, truth)) >= RECALL_TARGET:
                return nprobe, recall, candidates
            if exact is not None and recall <= previous + 0.002:
                break  # more lists no longer help: the codes' ranking limits it (more candidates may)
            previous = recall
    return nprobe, recall, candidates  # IVF-flat: every list, exact; PQ: the codes' limit


def recall_at(found: np.ndarray, truth: np.ndarray) -> float:
    """The share of the ids in `truth`'s rows that the same rows of `found` hold."""
    hits = total = 0
    for got, want in zip(found, truth, strict=False):
        want = want[want >= 0]
        hits += len(set(got.tolist()) & set(want.tolist()))
        total += len(want)
    return hits / max(total, 1)
