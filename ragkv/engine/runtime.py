"""What every online path answers with: the loaded model and its stored profile, the retriever
and the KV loader over one open generation, and the prefill accounting since open. `prepare`
is the one seam a prompt is built through (ask, conversations, the batcher, the fronts)."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any, TypeVar

from ragkv.core.config import AskSettings, SearchSettings, parse_reranker
from ragkv.core.errors import InputError
from ragkv.core.scope import Scope, bounded, cache_salt
from ragkv.engine.answer import Savings, Source
from ragkv.loading.loader import KVLoader
from ragkv.model.llm import LoadedModel
from ragkv.model.profiles import ActiveProfile
from ragkv.modes import calibration
from ragkv.modes.assemble import Assembly
from ragkv.retrieval.cross_encoder import CrossEncoders, cross_rerank
from ragkv.retrieval.rerank import FIRST_WEIGHT, KVReranker, Reranked
from ragkv.retrieval.retriever import Retrieved, Retriever, SearchResult
from ragkv.retrieval.search import Searched
from ragkv.store import Hit, StoreSnapshot

S = TypeVar("S", AskSettings, SearchSettings)


@dataclass
class Prepared:
    """A question ready to prefill: what `Runtime.prepare` returns."""

    retrieved: Retrieved
    prompt_ids: list[int]  # the whole prompt
    question_ids: list[int]  # its tail: the question with its template
    live_ids: list[int]  # the part to prefill now (after what the assembled cache holds)
    assembly: Assembly
    # What retrieving and loading did, for the answer's Stats (built once the answer is done,
    # Request.stats_of): the reports Stats.of reads, and the counts it takes as they are.
    reports: tuple
    counts: dict[str, Any]

    def sources(self) -> list[Source]:
        return [Source.of(r, score) for r, score in self.retrieved]


class Runtime:
    def __init__(
        self, lm: LoadedModel, active: ActiveProfile, retriever: Retriever, loader: KVLoader, scope: Scope | None = None
    ):
        self.lm = lm
        self.scope = scope  # the engine's own reach: every request's scope sits inside it
        self.active = active
        self.retriever = retriever
        self.loader = loader
        self.kv_reranker = KVReranker(loader, retriever, FIRST_WEIGHT)
        self.savings = Savings()  # every answer's prefill accounting, since open
        self.calibration = calibration.load(retriever.snapshot.catalog.meta(), active.profile.profile_id)

    @property
    def snapshot(self) -> StoreSnapshot:
        return self.retriever.snapshot

    def switch(self, snapshot: StoreSnapshot) -> None:
        """Answer from `snapshot` from now on."""
        self.retriever.switch(snapshot)
        self.loader.switch(snapshot)
        self.calibration = calibration.load(snapshot.catalog.meta(), self.active.profile.profile_id)

    def scoped(self, settings: S) -> S:
        """`settings` with their scope inside the engine's (unchanged without one)."""
        return bounded(settings, self.scope)

    def turn_counts(self, settings: AskSettings, reused: int, computed: int) -> dict[str, Any]:
        """A later turn's counts for its Stats (see Prepared.counts): nothing retrieved or
        loaded; `reused` prompt tokens are in the conversation's cache, `computed` to prefill."""
        return {
            "mode": self._mode(settings),
            "store_generation": self.snapshot.generation,
            "reused_tokens": reused,
            "computed_tokens": computed,
        }

    @staticmethod
    def _mode(settings: AskSettings) -> str:
        return settings.mode if settings.use_cache else "full"

    def prepare(self, question: str, settings: AskSettings) -> Prepared:
        """Retrieve (widened to `settings.context`, cut to fit), build the prompt ids, assemble
        what the store holds of the prompt into a cache, and log the chunks' uses. `--mode
        approximate` runs as the store's calibration says (ragkv.modes.calibration)."""
        settings = self.scoped(settings)
        with self.loader.tenant(cache_salt(settings.scope)):
            return self._prepare(question, settings)

    def _prepare(self, question: str, settings: AskSettings) -> Prepared:
        resolved = calibration.resolve(settings, self.calibration)
        settings = resolved.settings
        prompt = self.retriever.prompt_for(question, settings, functools.partial(self.best, settings=settings.search))
        load_start = time.perf_counter()
        loaded = self.loader.load([row for row, _ in prompt.retrieved], prompt.chunk_ids, settings, prompt.question_ids)
        kv_load_ms = (time.perf_counter() - load_start) * 1000.0
        self.loader.record_uses([row for row, _ in prompt.retrieved], loaded.kv_sources)
        assembly = loaded.assembly
        live_ids = prompt.prompt_ids[assembly.num_cached :]
        computed = sum(
            len(ids)
            for (row, _), ids in zip(prompt.retrieved, prompt.chunk_ids, strict=False)
            if loaded.kv_sources.get(row.chunk_id) == "computed"
        )  # prefilled now, as a miss
        counts = {
            "mode": "fallback" if loaded.fallback else self._mode(settings),
            "store_generation": self.snapshot.generation,
            "kv_load_ms": kv_load_ms,
            "reused_tokens": assembly.reused_tokens - computed,
            "computed_tokens": len(live_ids) + computed + assembly.computed_tokens,
        }
        reports = (resolved, prompt, loaded, assembly)  # the calibration's warning first
        return Prepared(prompt.retrieved, prompt.prompt_ids, prompt.question_ids, live_ids, assembly, reports, counts)

    def search(self, question: str, settings: SearchSettings) -> Searched:
        """The `settings.top_k` chunks for `question`, best first, as `SearchResult`s: the first
        stage's, or with `settings.rerank` > 1 the best of its first N as the model scores them
        (ragkv.retrieval.rerank; this uses the model, so call it where the engine's steps run)."""
        settings = self.scoped(settings)
        with self.loader.tenant(cache_salt(settings.scope)):
            return self._search(question, settings)

    def _search(self, question: str, settings: SearchSettings) -> Searched:
        searched = self.retriever.search(question, settings)
        latency = searched.latency_ms
        start = time.perf_counter()
        hits = self.retriever.rows(searched.hits)
        latency["catalog_ms"] = (time.perf_counter() - start) * 1000.0
        if settings.rerank < 2 or len(hits) < 2:
            results = [_result(row, score, score, None) for row, score in hits[: settings.top_k]]
            return Searched(results, searched.retrieval, searched.warnings, latency)
        reranked = self.rerank(question, hits, settings, latency)
        results = [_result(s.row, s.score, s.first_score, s.model_score) for s in reranked.scored[: settings.top_k]]
        return Searched(results, searched.retrieval, searched.warnings + reranked.warnings, latency)

    def rerank(
        self, question: str, candidates: Retrieved, settings: SearchSettings, latency: dict[str, float] | None = None
    ) -> Reranked:
        """`candidates` ordered by `settings.reranker` (ragkv.retrieval.cross_encoder): the model
        over their stored KV, a cross-encoder, or the first then the second on its best
        2 x top_k. Each one's time goes into `latency` (rerank_ms, cross_encoder_ms)."""
        latency = {} if latency is None else latency
        over_kv, cross = parse_reranker(settings.reranker)
        warnings: list[str] = []
        if over_kv:
            reranked = self.kv_reranker.rerank(question, candidates)
            latency["rerank_ms"] = reranked.rerank_ms
            if cross is None:
                return reranked
            warnings = reranked.warnings
            candidates = [(s.row, s.first_score) for s in reranked.scored[: 2 * settings.top_k]]
        assert cross is not None  # the stored-KV rerank alone returned above
        model = CrossEncoders.get(cross, self.loader.reads.device)
        crossed = cross_rerank(model, question, candidates)
        latency["cross_encoder_ms"] = crossed.rerank_ms
        crossed.warnings = warnings + crossed.warnings
        return crossed

    def best(
        self, question: str, candidates: Retrieved, top_k: int, settings: SearchSettings
    ) -> tuple[Retrieved, list[str]]:
        """The best `top_k` of `candidates` by `rerank`, with their scores, and warnings (what a
        prompt takes: `Retriever.prompt_for`)."""
        reranked = self.rerank(question, candidates, settings)
        return [(s.row, s.score) for s in reranked.scored[:top_k]], reranked.warnings

    def retrieve(self, question: str, settings: SearchSettings, context: str) -> Retrieved:
        """`search`'s chunks as catalog rows with their scores, widened to `context` (see
        `Retriever.widen`)."""
        found = self.search(question, settings).hits
        return self.retriever.widen(self.retriever.rows([Hit(r.chunk_id, r.score) for r in found]), context)

    def fit_budget(self, num_prompt_tokens: int, max_new_tokens: int, warnings: list[str]) -> int:
        """How many tokens an answer after `num_prompt_tokens` may have (at most
        `max_new_tokens`); a cut is said in `warnings`."""
        room = self.lm.facts.max_context - num_prompt_tokens
        if room < 1:
            raise InputError(
                f"the prompt is {num_prompt_tokens} tokens, over the model's context of {self.lm.facts.max_context}; "
                "ask a shorter question or use a smaller --top-k"
            )
        if room < max_new_tokens:
            warnings.append(f"max_new_tokens cut from {max_new_tokens} to {room} to fit the context")
        return min(room, max_new_tokens)


def _result(row, score: float, retrieval_score: float, likelihood: float | None) -> SearchResult:
    source = Source.of(row, score)  # where it is: section, pages and their citation
    return SearchResult(
        row.doc_id,
        row.source,
        row.chunk_index,
        row.chunk_id,
        row.text,
        score,
        retrieval_score,
        likelihood,
        source.section,
        source.pages,
        source.citation,
    )
