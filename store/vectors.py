"""The vector index of chunk embeddings: inner product over normalised vectors (= cosine); ids
are catalog chunk ids.

A generation's index is a list of immutable segment files (`segments/*.faiss`) and a set of
removed ids (tombstones, kept in the generation's catalog), so publishing a change writes only
the new vectors and the ids it removed, never the whole index:

- a small segment is exact: `IndexIDMap2(IndexFlatIP)`;
- a large one (at least IVF_MIN vectors) is an inverted file, `IndexIVFFlat`, whose `nprobe`
  is tuned when it is built for recall@10 >= RECALL_TARGET against exact search on queries
  near its own vectors, and recorded beside it in the generation manifest.

A writer collects added vectors in memory and publishes them as one new segment (flat, or
IVF when it adds IVF_MIN or more). Small flat segments are merged when there are more than
MAX_FLAT of them; a compaction (by `gc`, or by a writer once tombstones or flat segments
outgrow their share, or there are more than MAX_SEGMENTS segments) rewrites every live vector
into one segment: one IVF segment, retrained, for a large store.
"""

from __future__ import annotations

import os
import threading
import uuid
import weakref
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from ragkv.errors import StoreCorruptError
from store.generations import SEGMENT_DIR

IVF_MIN = 50_000  # a segment with fewer vectors is searched exactly
MAX_FLAT = 8  # flat segments a writer lets accumulate before it merges them
MAX_SEGMENTS = 12  # segments of any kind before a writer compacts them all into one
FLAT_SHARE = 0.05  # ... or once they hold this share of all vectors (beside an IVF segment)
GONE_SHARE = 0.10  # compact once this share of the stored vectors are tombstones
RECALL_TARGET = 0.95
_NPROBES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
_TUNE_QUERIES = 200


@dataclass(frozen=True)
class Hit:
    chunk_id: int
    score: float


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

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> SegmentInfo:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


class Segment:
    """A loaded segment file (shared by every snapshot of this process that lists it)."""

    def __init__(self, info: SegmentInfo, index: faiss.Index):
        self.info = info
        self.index = index
        self._ids: np.ndarray | None = None

    def ids(self) -> np.ndarray:
        if self._ids is None:
            self._ids = segment_ids(self.index)
        return self._ids

    def search(self, query: np.ndarray, k: int, selector=None) -> tuple[np.ndarray, np.ndarray]:
        return search_index(self.index, query, k, selector, self.info.nprobe if self.info.kind == "ivf" else 0)


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
    with _loaded_lock:
        if (segment := _loaded.get(key)) is not None:
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
    segment = Segment(info, index)
    with _loaded_lock:
        _loaded[key] = segment
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
    folder: Path, ids: np.ndarray, vectors: np.ndarray, tag: str, ivf: bool | None = None, seed: int = 0
) -> SegmentInfo:
    """Write `vectors` (normalised float32) under `ids` as a new segment file; an IVF segment
    when there are at least IVF_MIN of them (or `ivf`), its nprobe tuned here."""
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
    return SegmentInfo(name, "ivf" if use_ivf else "flat", len(ids), path.stat().st_size, nlist, nprobe, recall)


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


class VectorIndex:
    """One generation's vectors: its segments, its tombstones and (in a writer) the vectors
    added since it was opened. Segments load on first use, so a writer that only adds and
    removes never reads them."""

    def __init__(
        self,
        dim: int,
        folder: Path | None = None,
        segments: Sequence[SegmentInfo] = (),
        gone: np.ndarray | None = None,
        loaded: dict[str, Segment] | None = None,
    ):
        self.dim = dim
        self.folder = folder
        self.segments = list(segments)
        self.gone = np.unique(np.asarray(gone if gone is not None else [], dtype=np.int64))
        self._loaded: dict[str, Segment] = dict(loaded or {})
        # Vectors added since the last segment was written (None while the dimension is unknown).
        self._pending: Any = faiss.IndexIDMap2(faiss.IndexFlatIP(dim)) if dim else None
        self._selector = None
        self.num_changes = 0  # add/remove calls that changed the index since it was opened

    @classmethod
    def empty(cls, dim: int) -> VectorIndex:
        return cls(dim)

    # -- reading --------------------------------------------------------------------------------
    def segment(self, info: SegmentInfo) -> Segment:
        if info.name not in self._loaded:
            assert self.folder is not None  # an index without a folder holds only loaded segments
            self._loaded[info.name] = load_segment(self.folder, info)
        return self._loaded[info.name]

    def load_all(self) -> None:
        """Load every segment now (a reader opens with them; StoreCorruptError names a damaged one)."""
        for info in self.segments:
            self.segment(info)

    @property
    def pending_count(self) -> int:
        return self._pending.ntotal if self._pending is not None else 0

    def __len__(self) -> int:
        return sum(s.count for s in self.segments) - len(self.gone) + self.pending_count

    def ids(self) -> np.ndarray:
        """Every live id (loads the segments)."""
        parts = [self.segment(info).ids() for info in self.segments]
        stored = np.concatenate(parts) if parts else np.empty(0, np.int64)
        live = stored[~np.isin(stored, self.gone)] if len(self.gone) else stored
        pending = faiss.vector_to_array(self._pending.id_map).astype(np.int64) if self.pending_count else []
        return np.concatenate([live, np.asarray(pending, np.int64)])

    def search(self, vector: np.ndarray, k: int, allowed: list[int] | None = None) -> list[Hit]:
        """The `k` nearest chunks to one `(dim,)` query vector, best first; only chunk ids in
        `allowed` when given."""
        if allowed is not None:
            wanted = np.asarray(allowed, dtype=np.int64)
            if len(self.gone):
                wanted = wanted[~np.isin(wanted, self.gone)]
            k = min(k, len(wanted))
            selector = faiss.IDSelectorBatch(wanted) if k else None
        else:
            k = min(k, len(self))
            selector = self._gone_selector()
        if k < 1:
            return []
        query = np.ascontiguousarray(vector.reshape(1, -1), dtype=np.float32)
        scores, ids = [], []
        for info in self.segments:
            s, i = self.segment(info).search(query, k, selector)
            scores.append(s[0])
            ids.append(i[0])
        if self.pending_count:
            s, i = search_index(self._pending, query, k, selector)
            scores.append(s[0])
            ids.append(i[0])
        if not scores:
            return []
        all_scores, all_ids = np.concatenate(scores), np.concatenate(ids)
        keep = all_ids >= 0
        all_scores, all_ids = all_scores[keep], all_ids[keep]
        order = np.argsort(-all_scores, kind="stable")[:k]
        return [Hit(int(all_ids[j]), float(all_scores[j])) for j in order]

    def _gone_selector(self):
        if not len(self.gone):
            return None
        if self._selector is None:
            self._batch = faiss.IDSelectorBatch(self.gone)
            self._selector = faiss.IDSelectorNot(self._batch)
        return self._selector

    # -- writing --------------------------------------------------------------------------------
    def add(self, chunk_ids: list[int], vectors: np.ndarray) -> None:
        """vectors: `(N, dim)` float32, already normalised."""
        if len(chunk_ids):
            self.num_changes += 1
            self._pending.add_with_ids(
                np.ascontiguousarray(vectors, dtype=np.float32), np.asarray(chunk_ids, dtype=np.int64)
            )

    def remove(self, chunk_ids: list[int]) -> int:
        """Drop `chunk_ids`: from the vectors added since opening, or by tombstone from the
        segments (whose files never change). Returns how many were dropped."""
        if not len(chunk_ids):
            return 0
        ids = np.unique(np.asarray(chunk_ids, dtype=np.int64))
        removed = self._pending.remove_ids(ids) if self.pending_count else 0
        stored = self._stored_among(ids)
        fresh = stored[~np.isin(stored, self.gone)]
        if len(fresh):
            self.gone = np.union1d(self.gone, fresh)
            self._selector = None
        removed += len(fresh)
        self.num_changes += bool(removed)
        return removed

    def _stored_among(self, ids: np.ndarray) -> np.ndarray:
        """Those of `ids` some segment holds (without loading segments, when the caller passes
        ids it knows are indexed: every segment id is a catalog chunk id, and a chunk id is
        never reused, so an id not pending is stored)."""
        if self.pending_count:
            pending = faiss.vector_to_array(self._pending.id_map)
            ids = ids[~np.isin(ids, pending)]
        return ids if self.segments else np.empty(0, np.int64)

    def take_pending(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, vectors) added since opening, and forget them (they are being written)."""
        ids, vectors = segment_vectors(self._pending)
        self._pending.reset()
        return ids, vectors

    def live_vectors(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, vectors) of every live vector: segments less tombstones, and pending."""
        ids, vectors = [], []
        for info in self.segments:
            i, v = segment_vectors(self.segment(info).index)
            ids.append(i)
            vectors.append(v)
        if self.pending_count:
            i, v = segment_vectors(self._pending)
            ids.append(i)
            vectors.append(v)
        if not ids:
            return np.empty(0, np.int64), np.empty((0, self.dim), np.float32)
        all_ids, all_vectors = np.concatenate(ids), np.concatenate(vectors)
        keep = ~np.isin(all_ids, self.gone)
        return all_ids[keep], all_vectors[keep]

    def describe(self) -> dict:
        """For `ragkv stats`: the index type and its parameters."""
        ivf = [s for s in self.segments if s.kind == "ivf"]
        kind = "ivf-flat" if ivf else "flat"
        return {
            "type": kind,
            "vectors": len(self),
            "dim": self.dim,
            "segments": len(self.segments),
            "flat_segments": len(self.segments) - len(ivf),
            "tombstones": int(len(self.gone)),
            "nlist": max((s.nlist for s in ivf), default=0),
            "nprobe": max((s.nprobe for s in ivf), default=0),
            "tuned_recall_at_10": min((s.recall for s in ivf), default=1.0),
        }
