"""The cross-encoder rerank: a sentence-transformers `CrossEncoder` (ms-marco-MiniLM, bge-reranker,
any folder or hub id) reads the question beside each candidate's text and scores the pair.

It is the standard second stage of RAG pipelines (LlamaIndex's SentenceTransformerRerank,
LangChain's CrossEncoderReranker). ragkv's own rerank (ragkv.retrieval.rerank) scores over the
stored KV instead: cheap per candidate with a large model, weak with a small one. A setting's
`reranker` names which runs on the `--rerank N` candidates:

    kv           the model over the stored KV (the default)
    MODEL        the cross-encoder MODEL
    kv+MODEL     the stored-KV rerank on the N, then the cross-encoder on its best 2 x top_k

A cross-encoder is loaded once per process and device (`CrossEncoders.get`), and scores all the
candidates in batches. The candidates are ordered by its score alone.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from ragkv.core.config import KV_RERANKER, parse_reranker
from ragkv.core.errors import ModelError
from ragkv.retrieval.rerank import Reranked, Scored
from ragkv.retrieval.retriever import Retrieved

__all__ = ["KV_RERANKER", "CrossEncoders", "cross_rerank", "parse_reranker"]

BATCH = 32  # pairs per forward


class CrossEncoders:
    """The cross-encoders this process has loaded, by (name, device): each loaded once."""

    _loaded: dict[tuple[str, str], Any] = {}
    _lock = threading.Lock()

    @classmethod
    def get(cls, name: str, device: str):
        with cls._lock:
            key = (name, device)
            if key not in cls._loaded:
                cls._loaded[key] = _load(name, device)
            return cls._loaded[key]


def _load(name: str, device: str):
    from sentence_transformers import CrossEncoder

    from ragkv.model.llm import quiet_loading

    try:
        with quiet_loading():
            return CrossEncoder(name, device=device)
    except Exception as exc:
        raise ModelError(f"could not load cross-encoder {name!r}: {exc}".splitlines()[0]) from exc


def cross_rerank(model, question: str, candidates: Retrieved) -> Reranked:
    """`candidates` (row, first-stage score) ordered by `model`'s score of (question, chunk text),
    best first."""
    start = time.perf_counter()
    scores = scores_of(model, question, [row.text for row, _ in candidates])
    scored = [Scored(row, first, score, score) for (row, first), score in zip(candidates, scores, strict=True)]
    scored.sort(key=lambda s: -s.score)
    return Reranked(scored, (time.perf_counter() - start) * 1000.0)


def scores_of(model, question: str, texts: Sequence[str]) -> list[float]:
    """`model`'s score of each (question, text) pair, in batches."""
    if not texts:
        return []
    pairs = [(question, text) for text in texts]
    scores = model.predict(pairs, batch_size=BATCH, show_progress_bar=False, convert_to_numpy=True)
    return [float(s) for s in scores.reshape(len(texts), -1)[:, -1]]  # one logit, or the last class's
