"""The online path's facade: retrieve, load the stored KV as the prompt prefix, prefill only the
rest, generate. `QueryEngine` is what `ragkv.open()` returns and what the CLI's `ask` drives;
the work is done by the `Runtime` it holds (ragkv.retrieval, ragkv.loading.loader)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path

import torch

from ragkv.core.config import (
    DEFAULT_RETRIEVAL,
    KV_DTYPES,
    KV_RERANKER,
    AskSettings,
    BatchSettings,
    SearchSettings,
)
from ragkv.core.errors import InputError, ModelError
from ragkv.core.lru import ByteLRU
from ragkv.core.scope import Scope
from ragkv.engine.active import ActiveProfile, open_embedder, open_model
from ragkv.engine.answer import Answer, AnswerStream, Savings
from ragkv.engine.conversation import Conversation
from ragkv.engine.engine import Engine
from ragkv.engine.overview import chunk_texts
from ragkv.engine.runtime import Prepared, Runtime
from ragkv.kv.entry import Entry
from ragkv.loading.loader import KVLoader
from ragkv.model.device import resolve_device
from ragkv.model.generate import prefill
from ragkv.model.llm import LoadedModel
from ragkv.modes.assemble import Assembly
from ragkv.modes.prefix_cache import PrefixCache
from ragkv.retrieval.retriever import Prompt, Retrieved, Retriever
from ragkv.retrieval.search import Searched
from ragkv.store import ContextRow, StoreSnapshot, open_snapshot
from ragkv.store.kv.writeback import PENDING_BYTES

__all__ = ["ActiveProfile", "Prepared", "Prompt", "QueryEngine"]


class QueryEngine:
    """Answers questions from a store. Loads the model and embedder once; holds one published
    generation open (and leased) until `refresh()` moves it to a newer one or `close()`."""

    def __init__(
        self,
        store: Path | str,
        model: str | None = None,
        embedder: str | None = None,
        device: str = "auto",
        dtype: str | None = None,
        kv_dtype: str | None = None,
        prefix_cache_bytes: int = 512 << 20,
        ram_bytes: int = 1 << 30,
        write_back: bool = True,
        weights: bool = True,
        log_uses: bool = True,
        pending_bytes: int = PENDING_BYTES,
        leave_pending: bool = False,
        scope: Scope | Mapping | None = None,
        share: QueryEngine | None = None,
        isolate_tenants: bool = False,
    ):
        if kv_dtype is not None and kv_dtype not in KV_DTYPES:
            raise InputError(f"unknown --kv-dtype {kv_dtype!r}; use one of {', '.join(KV_DTYPES)}")
        snapshot = open_snapshot(store)
        try:
            self.device = resolve_device(device)
            loaded: LoadedModel | None = share.lm if share is not None else None
            lm, active = open_model(snapshot, model, self.device, dtype, kv_dtype, weights, loaded)
            self.embedder = open_embedder(snapshot, embedder, self.device)
        except BaseException:
            snapshot.close()
            raise
        retriever = Retriever(
            snapshot, self.embedder, lm.tokenizer, active.layout, active.profile.profile_id, lm.facts.max_context
        )
        loader = KVLoader(
            snapshot,
            lm,
            active,
            self.device,
            prefix_cache_bytes,
            ram_bytes,
            write_back,
            log_uses,
            pending_bytes,
            leave_pending,
            isolate_tenants,
        )
        self.runtime = Runtime(lm, active, retriever, loader, Scope.of(scope))
        # every answer of this store is a request to `engine`, over this store's runtime; `share`:
        # another store's QueryEngine, whose model this one uses and whose engine (so whose batch)
        # its requests join
        self.engine: Engine = Engine(self.runtime) if share is None else share.engine
        self.lm: LoadedModel = lm
        self.active, self.loader = active, loader

    @property
    def snapshot(self) -> StoreSnapshot:
        return self.runtime.snapshot

    @property
    def savings(self) -> Savings:
        return self.runtime.savings

    @property
    def ram(self) -> ByteLRU[Entry]:
        """The RAM tier of verified chunk entries (assignable, to resize it)."""
        return self.loader.ram

    @ram.setter
    def ram(self, tier: ByteLRU[Entry]) -> None:
        self.loader.ram = tier

    def hot(self) -> dict:
        """What the RAM tier holds of the store's KV (see `KVLoader.hot`); `ragkv serve`'s `/v1/cache`."""
        return self.engine.call(self.loader.hot)

    @property
    def prefix_cache(self) -> PrefixCache:
        return self.loader.prefix_cache

    @prefix_cache.setter
    def prefix_cache(self, cache: PrefixCache) -> None:
        self.loader.prefix_cache = cache

    def refresh(self) -> bool:
        """Switch to the store's newest published generation if there is one (between
        questions: an answer always comes from one generation). Returns whether it switched."""
        if self.snapshot.latest_generation() == self.snapshot.generation:
            return False
        snapshot = open_snapshot(self.snapshot.location)
        profile_id = self.active.profile.profile_id
        if all(p.profile_id != profile_id for p in snapshot.catalog.entries.profiles()):
            snapshot.close()
            raise ModelError(f"the store's new generation no longer holds KV for model {self.lm.facts.name}; reopen it")
        old = self.snapshot
        self.runtime.switch(snapshot)
        old.close()
        return True

    # -- the query path -------------------------------------------------------------------
    def search(
        self,
        question: str,
        top_k: int = 5,
        *,
        retrieval: str = DEFAULT_RETRIEVAL,
        rerank: int = 0,
        doc_ids: Sequence[str] | None = None,
        filters: Sequence[str] = (),
        settings: SearchSettings | None = None,
        reranker: str = KV_RERANKER,
    ) -> Searched:
        """The `top_k` chunks for `question` (`SearchResult`s), best first, without generating:
        the first stage's (`retrieval`: dense, lexical or hybrid), or with `rerank` N > 1 the
        best of its first N as the model scores them over their stored KV (ragkv.retrieval.rerank); only
        from the documents `doc_ids` names and `filters` admit (ragkv.core.filters). Iterate it for
        the results; `.warnings` says what fell back. `ragkv search`, `/v1/retrieve` and the
        framework retrievers all call this. `settings`, when given, stands for all the others."""
        settings = settings or SearchSettings(
            top_k, retrieval, rerank, _ids(doc_ids), tuple(filters), reranker=reranker
        )
        return self.engine.call(self.runtime.search, question, settings)

    def search_soon(self, question: str, settings: SearchSettings) -> Future:
        """`search`, without waiting (for an event loop): a future of its `Searched`."""
        return self.engine.call_soon(self.runtime.search, question, settings)

    def chunk_texts(self, chunk_ids: Sequence[int], scope: Scope | Mapping | None = None) -> dict[int, str]:
        """The stored text of each of `chunk_ids` the scope (and the engine's) admits; others are
        left out as if they did not exist (read between two steps, which own the catalog)."""
        return self.engine.call(chunk_texts, self.runtime, chunk_ids, Scope.of(scope))

    def retrieve(
        self,
        question: str,
        top_k: int = 1,
        doc_ids: Sequence[str] | None = None,
        context: str = "chunk",
        rerank: int = 0,
        *,
        retrieval: str = DEFAULT_RETRIEVAL,
        filters: Sequence[str] = (),
        reranker: str = KV_RERANKER,
    ) -> Retrieved:
        """`search`'s chunks as catalog rows with their scores, widened to `context` (see
        `ragkv.retrieval.retriever.Retriever.widen`)."""
        settings = SearchSettings(top_k, retrieval, rerank, _ids(doc_ids), tuple(filters), reranker=reranker)
        return self.engine.call(self.runtime.retrieve, question, settings, context)

    def prompt_for(self, question: str, settings: AskSettings) -> Prompt:
        """The question's chunks and prompt ids, without loading any KV (a front for another
        engine, ragkv.serve.vllm_front, sends these ids)."""
        return self.runtime.retriever.prompt_for(question, self.runtime.scoped(settings))

    def prepare(self, question: str, settings: AskSettings) -> Prepared:
        """The prompt with its cache assembled from the store (see `Runtime.prepare`)."""
        return self.runtime.prepare(question, settings)

    def assemble(self, rows: list[ContextRow], settings: AskSettings) -> Assembly:
        """The cache a prompt over `rows` starts from, per `settings.mode` (see ragkv.loading.loader)."""
        chunk_ids = [self.chunk_token_ids(row) for row in rows]
        return self.loader.load(rows, chunk_ids, self.runtime.scoped(settings)).assembly

    def chunk_token_ids(self, row: ContextRow) -> tuple[int, ...]:
        return self.runtime.retriever.chunk_token_ids(row)

    def ask(self, question: str, settings: AskSettings | None = None, **options) -> Answer:
        """Answer `question` (options as in `AskSettings`: top_k, max_new_tokens, use_cache, mode)."""
        return self.engine.ask(question, settings or AskSettings.from_dict(options), self.runtime)

    def stream(
        self,
        question: str,
        settings: AskSettings | None = None,
        history: Sequence[tuple[str, str]] = (),
        **options,
    ) -> AnswerStream:
        """Like `ask`, but iterate the result for text as it is generated. `history`: earlier
        (user, assistant) turns, as a stateless client sends them, replayed first."""
        return self.engine.ask_stream(question, settings or AskSettings.from_dict(options), history, self.runtime)

    @contextmanager
    def batched(self, **settings) -> Iterator[QueryEngine]:
        """Step this engine in a background thread while inside (settings as in `BatchSettings`:
        max_batch, max_batch_tokens, prefill_chunk, max_queue); yields the engine itself. Call
        `ask` from many threads meanwhile: their answers decode together, each equal to asking
        alone (float32). Threads batch without it too; the thread only saves them stepping.
        Leaving finishes what is queued, then stops the thread. An engine opened with `share=`
        steps on the other's engine: its batch is that one's."""
        self.engine.start(BatchSettings(**settings))
        try:
            yield self
        finally:
            self.engine.stop()

    def conversation(
        self, settings: AskSettings | None = None, history: Sequence[tuple[str, str]] = (), **options
    ) -> Conversation:
        """A multi-turn conversation: its first message retrieves, later ones reuse the cache.
        `history`: earlier (user, assistant) turns as a client remembers them, replayed (see
        `Conversation.replay`; a stateless client such as an OpenAI one sends them each time)."""
        return self.engine.conversation(settings or AskSettings.from_dict(options), history, self.runtime)

    def first_token_logits(self, question: str, settings: AskSettings | None = None, **options) -> torch.Tensor:
        """The next-token logits `(V,)` after the prompt, as `ask` would see them (for comparing
        the cached path with a full prefill: exactness tests, fidelity evaluations)."""
        prepared = self.prepare(question, settings or AskSettings.from_dict(options))
        assembly = prepared.assembly
        return prefill(assembly.attending(self.lm.model), prepared.live_ids, assembly.cache, assembly.recompute).float()

    def flush(self) -> None:
        """Wait until KV computed on misses so far is written to the store (or given up)."""
        self.loader.flush()

    def close(self) -> None:
        """Finish the write-back, then release the store."""
        self.loader.close()
        self.snapshot.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _ids(doc_ids: Sequence[str] | None) -> tuple[str, ...] | None:
    """As a tuple (a single string is left for SearchSettings to refuse, not split into letters)."""
    if doc_ids is None or isinstance(doc_ids, str):
        return doc_ids  # type: ignore[return-value]
    return tuple(doc_ids)
