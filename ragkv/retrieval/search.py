"""The first stage of retrieval: the chunks nearest a question by meaning (dense: the embedder's
vectors, cosine), by its words (lexical: BM25 over the chunks' text, ragkv.store.index.lexical), or both
fused (hybrid). The rerank (ragkv.retrieval.rerank) orders what this finds.

Hybrid fuses the two lists by a weighted sum of each list's scores scaled to [0, 1] over its
candidates (a chunk one list did not find scores 0 there): `(1 - w) * dense + w * lexical`,
w = LEXICAL_WEIGHT, measured by benchmarks/retrieval.py (see the README's retrieval page).
A question with no words the lexical index can match on (only stop words, emoji), or a store
whose lexical index is damaged or incomplete, is answered by dense search, and says so.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from ragkv.core.errors import StoreCorruptError
from ragkv.model.embed import Embedder
from ragkv.store import Hit, VectorIndex
from ragkv.store.index.lexical import query_terms

LEXICAL_WEIGHT = 0.2  # hybrid: the lexical list's weight beside the dense one's (benchmarks/retrieval.py: dev halves)
FUSION_DEPTH = 30  # hybrid: each list's candidates, at least (more when more are asked for)


@dataclass
class Searched:
    """What a search found, best first (iterating it gives them), and what it had to say.
    hits: `store.Hit`s from the first stage, `SearchResult`s from `QueryEngine.search`."""

    hits: list
    retrieval: str  # what answered: the one asked for, or "dense" when lexical could not
    warnings: list[str] = field(default_factory=list)
    # ms per stage: embed, dense, lexical, fuse (the first stage's), catalog, rerank (the engine's)
    latency_ms: dict[str, float] = field(default_factory=dict)

    def __iter__(self) -> Iterator:
        return iter(self.hits)

    def __len__(self) -> int:
        return len(self.hits)

    def __getitem__(self, index):
        return self.hits[index]


def first_stage(
    vectors: VectorIndex,
    embedder: Embedder,
    question: str,
    k: int,
    retrieval: str = "dense",
    allowed: Sequence[int] | None = None,
) -> Searched:
    """The `k` best chunks for `question` by `retrieval` (one of RETRIEVALS); only chunk ids in
    `allowed` when given. Each stage's time is in the result's `latency_ms`."""
    latency: dict[str, float] = {}

    def dense(depth: int) -> list[Hit]:
        start = time.perf_counter()
        vector = embedder.embed_queries([question])[0]
        latency["embed_ms"] = _ms(start)
        start = time.perf_counter()
        hits = vectors.search(vector, depth, allowed)
        latency["dense_ms"] = _ms(start)
        return hits

    if retrieval == "dense":
        return Searched(dense(k), "dense", latency_ms=latency)
    terms, why_not = query_terms(question), ""
    if not terms:
        why_not = "the question has no words a lexical search can match on"
    elif missing := vectors.num_without_terms():
        why_not = (
            f"the store's lexical index does not cover {missing} chunks yet (written before it; ragkv gc builds it)"
        )
    if not why_not:
        depth = k if retrieval == "lexical" else max(2 * k, FUSION_DEPTH)
        start = time.perf_counter()
        try:
            lexical = vectors.search_terms(terms, depth, allowed)
        except StoreCorruptError as exc:
            why_not = str(exc)
        latency["lexical_ms"] = _ms(start)
    if why_not:
        return Searched(dense(k), "dense", [f"{why_not}: dense retrieval only"], latency)
    if retrieval == "lexical":
        return Searched(lexical, "lexical", latency_ms=latency)
    candidates = dense(max(2 * k, FUSION_DEPTH))
    start = time.perf_counter()
    fused = fuse(candidates, lexical, LEXICAL_WEIGHT)[:k]
    latency["fuse_ms"] = _ms(start)
    return Searched(fused, "hybrid", latency_ms=latency)


def _ms(since: float) -> float:
    return (time.perf_counter() - since) * 1000.0


def fuse(dense: Sequence[Hit], lexical: Sequence[Hit], lexical_weight: float) -> list[Hit]:
    """Both lists' chunks by `(1 - w) * dense + w * lexical`, each list's scores scaled to
    [0, 1] over its own candidates (0 where a list did not find the chunk), best first; ties
    by the dense order, then chunk id."""
    fused: dict[int, float] = {}
    for hits, weight in ((dense, 1.0 - lexical_weight), (lexical, lexical_weight)):
        for chunk_id, scaled in zip((h.chunk_id for h in hits), _scaled([h.score for h in hits]), strict=True):
            fused[chunk_id] = fused.get(chunk_id, 0.0) + weight * scaled
    order = {h.chunk_id: i for i, h in enumerate(dense)}
    ranked = sorted(fused.items(), key=lambda item: (-item[1], order.get(item[0], len(order)), item[0]))
    return [Hit(chunk_id, score) for chunk_id, score in ranked]


def _scaled(scores: Sequence[float]) -> np.ndarray:
    """Min-max scaled to [0, 1]; a single score, or equal ones, scale to 1."""
    values = np.asarray(scores, dtype=np.float64)
    if not len(values):
        return values
    low, high = values.min(), values.max()
    return np.ones_like(values) if high - low < 1e-12 else (values - low) / (high - low)
