"""The chunk index of one generation: its segments (ragkv.store.index.segments: each a set of chunk ids'
vectors and words), the ids removed since (tombstones, kept in the generation's catalog) and,
in a writer, what was added since it opened. Dense search is inner product over normalised
vectors (= cosine); lexical search is BM25 over the same chunks (ragkv.store.index.lexical). Ids are
catalog chunk ids, never reused.

Publishing a change writes only the chunks it added (one new segment) and the ids it removed,
never the whole index. The index keeps its own bounds (`publish`): small flat segments are
merged once there are more than MAX_FLAT of them; a compaction rewrites every live chunk into
one segment (one IVF segment, retrained, for a large store) once tombstones or flat segments
outgrow their share, or there are more than MAX_SEGMENTS segments; `gc` compacts whenever
there is more than one segment or any tombstone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from ragkv.store.index.build import build_segment, with_terms
from ragkv.store.index.lexical import Postings, bm25
from ragkv.store.index.segments import Segment, SegmentInfo, load_segment, search_index, segment_vectors

MAX_FLAT = 8  # flat segments a writer lets accumulate before it merges them
MAX_SEGMENTS = 12  # segments of any kind before a writer compacts them all into one
FLAT_SHARE = 0.05  # ... or once they hold this share of all vectors (beside an IVF segment)
GONE_SHARE = 0.10  # compact once this share of the stored vectors are tombstones

TextsOf = Callable[[Sequence[int]], dict[int, str]]  # chunk ids -> their texts (the catalog's)


@dataclass(frozen=True)
class Hit:
    chunk_id: int
    score: float


class VectorIndex:
    """One generation's chunk index: its segments, its tombstones and (in a writer) the vectors
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
        self._loaded: dict[SegmentInfo, Segment] = {
            info: loaded[info.name] for info in self.segments if loaded and info.name in loaded
        }
        # Vectors added since the last segment was written (None while the dimension is unknown).
        self._pending: Any = faiss.IndexIDMap2(faiss.IndexFlatIP(dim)) if dim else None
        self._selector = None
        self._alive: dict[SegmentInfo, np.ndarray] = {}  # each segment's live rows of its postings
        self._opened_with = [s.files() for s in self.segments]
        self._num_changes = 0  # add/remove calls that changed the index since it was opened

    @classmethod
    def empty(cls, dim: int) -> VectorIndex:
        return cls(dim)

    # -- reading --------------------------------------------------------------------------------
    def segment(self, info: SegmentInfo) -> Segment:
        if info not in self._loaded:
            assert self.folder is not None  # an index without a folder holds only loaded segments
            self._loaded[info] = load_segment(self.folder, info)
        return self._loaded[info]

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

    def search(self, vector: np.ndarray, k: int, allowed: Sequence[int] | None = None) -> list[Hit]:
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
            s, i = self.segment(info).search(query, k, selector, filtered=allowed is not None)
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

    def num_without_terms(self) -> int:
        """Chunks in segments that have no lexical file (written before the lexical index)."""
        return sum(s.count for s in self.segments if not s.has_terms)

    def search_terms(self, terms: Sequence[str], k: int, allowed: Sequence[int] | None = None) -> list[Hit]:
        """The `k` best chunks for `terms` (ragkv.store.index.lexical.query_terms) by BM25, best first; only
        chunk ids in `allowed` when given. Segments without a lexical file are not searched
        (see `num_without_terms`); a damaged one raises StoreCorruptError naming it. Chunks
        added in a writer are not searched until written."""
        parts = []
        for info in self.segments:
            postings = self.segment(info).postings()
            if postings is not None:
                parts.append((postings, self._alive_rows(info, postings)))
        wanted = None if allowed is None else np.asarray(allowed, dtype=np.int64)
        return [Hit(s.chunk_id, s.score) for s in bm25(parts, terms, k, wanted)]

    def _alive_rows(self, info: SegmentInfo, postings: Postings) -> np.ndarray:
        if info not in self._alive:
            self._alive[info] = (
                ~np.isin(postings.chunk_ids, self.gone) if len(self.gone) else np.ones(len(postings.chunk_ids), bool)
            )
        return self._alive[info]

    def _gone_selector(self):
        if not len(self.gone):
            return None
        if self._selector is None:
            self._batch = faiss.IDSelectorBatch(self.gone)
            self._selector = faiss.IDSelectorNot(self._batch)
        return self._selector

    # -- writing --------------------------------------------------------------------------------
    def add(self, chunk_ids: Sequence[int], vectors: np.ndarray) -> None:
        """vectors: `(N, dim)` float32, already normalised. Their words are read from the
        catalog when they are written (`publish`)."""
        if len(chunk_ids):
            self._num_changes += 1
            self._pending.add_with_ids(
                np.ascontiguousarray(vectors, dtype=np.float32), np.asarray(chunk_ids, dtype=np.int64)
            )

    def remove(self, chunk_ids: Sequence[int]) -> int:
        """Drop `chunk_ids`: from the vectors added since opening, or by tombstone from the
        segments (whose files never change). Returns how many were dropped."""
        if not len(chunk_ids):
            return 0
        ids = np.unique(np.asarray(chunk_ids, dtype=np.int64))
        removed = self._pending.remove_ids(ids) if self.pending_count else 0
        stored = self._stored_among(ids)
        fresh = stored[~np.isin(stored, self.gone)]
        if len(fresh):
            self._set_gone(np.union1d(self.gone, fresh))
        removed += len(fresh)
        self._num_changes += bool(removed)
        return removed

    def mark_changed(self) -> None:
        """Publish this index even if nothing was added or removed (a repair's rebuilt one)."""
        self._num_changes += 1

    def changed(self) -> bool:
        """Whether publishing would write anything: chunks added or removed, or segments
        rewritten, since it was opened."""
        return self._num_changes > 0 or [s.files() for s in self.segments] != self._opened_with

    def _set_gone(self, gone: np.ndarray) -> None:
        self.gone = gone
        self._selector = None
        self._alive.clear()

    def _stored_among(self, ids: np.ndarray) -> np.ndarray:
        """Those of `ids` some segment holds (without loading segments, when the caller passes
        ids it knows are indexed: every segment id is a catalog chunk id, and a chunk id is
        never reused, so an id not pending is stored)."""
        if self.pending_count:
            pending = faiss.vector_to_array(self._pending.id_map)
            ids = ids[~np.isin(ids, pending)]
        return ids if self.segments else np.empty(0, np.int64)

    def live_vectors(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, vectors) of every live vector: segments less tombstones, and pending."""
        ids, vectors = [], []
        for info in self.segments:
            i, v = self.segment(info).vectors()
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

    # -- the segment policy -----------------------------------------------------------------------
    def publish(self, tag: str, texts_of: TextsOf) -> dict:
        """Write what changed, keeping the index within its bounds: the chunks added as a new
        segment (IVF if large) with their words (`texts_of`), a lexical file for each segment
        that lacks one, then a merge of small flat segments or a compaction (see the module).
        Returns the manifest's part: `{"dim", "segments"}`. Tombstones stay in `gone` (the
        writer records them in its catalog)."""
        assert self.folder is not None  # a writer's index has its store's segment folder
        stored = sum(s.count for s in self.segments)
        if self.pending_count:
            ids, added = segment_vectors(self._pending)
            self._pending.reset()
            self.segments.append(build_segment(self.folder, ids, added, _postings(ids, texts_of), tag))
            stored += len(ids)
        self.segments = [self._with_terms(s, tag, texts_of) for s in self.segments]
        flat = [s for s in self.segments if s.kind == "flat"]
        large = stored - sum(s.count for s in flat)
        if self.segments and (
            len(self.gone) > GONE_SHARE * stored
            or len(self.segments) > MAX_SEGMENTS
            or (large and sum(s.count for s in flat) > FLAT_SHARE * stored)
        ):
            self.compact(tag, texts_of)
        elif len(flat) > MAX_FLAT:
            self._merge(flat, tag, texts_of)
        return {"dim": self.dim, "segments": [s.to_dict() for s in self.segments]}

    def needs_compaction(self) -> bool:
        """What gc asks: more than one segment, or any tombstone."""
        return len(self.segments) > 1 or len(self.gone) > 0

    def compact(self, tag: str, texts_of: TextsOf) -> None:
        """Rewrite every live chunk as one segment: IVF, retrained, for a large store. Costs
        what the index holds."""
        assert self.folder is not None  # a writer's index has its store's segment folder
        ids, data = self.live_vectors()
        postings = self._live_postings(self.segments, ids, texts_of)
        self.segments = [build_segment(self.folder, ids, data, postings, tag)] if len(ids) else []
        self._set_gone(np.empty(0, np.int64))
        self._loaded.clear()
        self._num_changes += 1

    def _merge(self, chosen: list[SegmentInfo], tag: str, texts_of: TextsOf) -> None:
        """Rewrite the segments `chosen` (small, flat) as one flat segment, less tombstones."""
        assert self.folder is not None  # a writer's index has its store's segment folder
        parts = [self.segment(s).vectors() for s in chosen]
        ids = np.concatenate([p[0] for p in parts])
        data = np.concatenate([p[1] for p in parts])
        keep = ~np.isin(ids, self.gone)
        postings = self._live_postings(chosen, ids[keep], texts_of)
        self._set_gone(self.gone[~np.isin(self.gone, ids)])
        merged = build_segment(self.folder, ids[keep], data[keep], postings, tag, ivf=False)
        names = {s.name for s in chosen}
        self.segments = [s for s in self.segments if s.name not in names] + [merged]
        self._num_changes += 1

    def _with_terms(self, info: SegmentInfo, tag: str, texts_of: TextsOf) -> SegmentInfo:
        """`info`, given a lexical file when it has none of the current analyser (a segment
        written before the lexical index or by another analyser, or one `verify --repair` found
        damaged and dropped), from its chunks' texts."""
        if info.has_terms:
            return info
        assert self.folder is not None  # a writer's index has its store's segment folder
        ids = self.segment(info).ids()
        return with_terms(self.folder, info, _postings(ids, texts_of), tag)

    def _live_postings(self, segments: Sequence[SegmentInfo], ids: np.ndarray, texts_of: TextsOf) -> Postings:
        """The postings of `ids` (live chunks of `segments`, and pending ones): joined from the
        segments' lexical files, the rest (pending, or a segment without one) from their texts."""
        parts, covered = [], []
        for info in segments:
            postings = self.segment(info).postings()
            if postings is not None:
                keep = np.isin(postings.chunk_ids, ids)
                parts.append((postings, keep))
                covered.append(postings.chunk_ids[keep])
        rest = ids[~np.isin(ids, np.concatenate(covered))] if covered else ids
        if len(rest):
            fresh = _postings(rest, texts_of)
            parts.append((fresh, np.ones(len(rest), bool)))
        return Postings.joined(parts)

    def drop_terms(self, names: set[str]) -> None:
        """Forget the lexical files `names` (found damaged): `publish` rebuilds them."""
        self.segments = [
            SegmentInfo.from_dict({**s.to_dict(), "terms": "", "terms_nbytes": 0}) if s.terms in names else s
            for s in self.segments
        ]

    def describe(self) -> dict:
        """For `ragkv stats`: the index type and its parameters."""
        ivf = [s for s in self.segments if s.kind != "flat"]
        kinds = {s.kind for s in ivf}
        kind = "ivf-pq" if "ivfpq" in kinds else "ivf-flat" if ivf else "flat"
        return {
            "type": kind,
            "ram_bytes": sum(s.ram_bytes(self.dim) for s in self.segments) + self.pending_count * (self.dim * 4 + 8),
            "rescore": max((s.rescore for s in ivf), default=0),
            "vectors": len(self),
            "dim": self.dim,
            "segments": len(self.segments),
            "flat_segments": len(self.segments) - len(ivf),
            "tombstones": int(len(self.gone)),
            "nlist": max((s.nlist for s in ivf), default=0),
            "nprobe": max((s.nprobe for s in ivf), default=0),
            "tuned_recall_at_10": min((s.recall for s in ivf), default=1.0),
            "lexical": "bm25" if not self.num_without_terms() else f"missing for {self.num_without_terms()} chunks",
            "lexical_bytes": sum(s.terms_nbytes for s in self.segments),
        }


def _postings(ids: np.ndarray, texts_of: TextsOf) -> Postings:
    """The postings of chunks `ids` from their texts (a chunk without one has no words)."""
    texts = texts_of([int(i) for i in ids]) if len(ids) else {}
    return Postings.of_texts(ids, [texts.get(int(i), "") for i in ids])
