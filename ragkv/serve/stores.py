"""The one way a route reaches a store, in both fronts (ragkv.serve.service, ragkv.serve.vllm_front):
`Stores.open(model, caller)` returns a `StoreHandle`, which already holds the caller's scope, its
token cap and the audit log, and applies them to everything the route asks of the store. A
route holds no engine: the handle is the only object that reaches one, and it is handed out only
for a caller (the routes' `Access` dependency). This is the only module of ragkv.serve that
imports the engine, loading or retrieval layers (tests/test_layering.py holds the rest to that,
and tests/test_tenants.py every route to taking a caller).

A store the caller may not use answers as one that does not exist (`UnknownModel`), and
`/v1/models` lists only the caller's.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

from ragkv.core.config import AskSettings, SearchSettings
from ragkv.core.scope import bounded
from ragkv.engine.answer import Source, Stats, reply
from ragkv.engine.overview import chunk_texts, overview
from ragkv.engine.scheduler import Busy
from ragkv.loading.loader import continues_span
from ragkv.serve.access import SERVED_MODEL_ID, Forbidden, UnknownModel, require_unfiltered
from ragkv.serve.api import ChatRequest, RetrieveRequest, ServeSettings, check_reranker, max_tokens
from ragkv.serve.api_keys import Caller

__all__ = ["Busy", "Forbidden", "StoreHandle", "Stores", "layout_params"]


class StoreHandle:
    """One caller's way into one store, for one request: every setting it builds is inside the
    caller's scope and caps, and every use it records goes to the audit log with the caller."""

    def __init__(self, name: str, engine, caller: Caller, audit, settings: ServeSettings):
        self.name, self.caller = name, caller
        self._engine, self._audit, self._settings = engine, audit, settings

    def ask_settings(self, body: ChatRequest, warnings: list[str]) -> AskSettings:
        """The chat request's settings: inside the caller's scope, `max_tokens` cut to the server's
        and the key's caps (said in `warnings`), a cross-encoder only one the server offers."""
        check_reranker(self._settings, body.ragkv.reranker)
        budget = max_tokens(body, self._settings, warnings, self.caller.max_tokens)
        return bounded(body.ask_settings(budget), self.caller.scope)

    def search_settings(self, body: RetrieveRequest) -> SearchSettings:
        """The retrieve request's settings, inside the caller's scope."""
        check_reranker(self._settings, body.reranker)
        return bounded(body.settings(), self.caller.scope)

    def search_soon(self, query: str, settings: SearchSettings) -> Future:
        """The search, run where the engine's steps run (`settings` from `search_settings`)."""
        return self._engine.search_soon(query, settings)

    def hot_soon(self, stepped) -> Future:
        """What the store holds hot (`QueryEngine.hot`), run on `stepped`'s thread. It names
        every hot document, so a key with filters is Forbidden."""
        require_unfiltered(self.caller, "/v1/cache names every hot document")
        return stepped.call_soon(self._engine.loader.hot)

    def overview_soon(self, stepped) -> Future:
        """What the store holds as this caller may see it (ragkv.engine.overview), run on
        `stepped`'s thread: a key with filters gets its own documents and no store-wide figure."""
        return stepped.call_soon(overview, self._engine.runtime, self.caller.scope)

    def chunk_texts_soon(self, stepped, chunk_ids: list[int]) -> Future:
        """The texts of those of `chunk_ids` the caller may see, run on `stepped`'s thread."""
        return stepped.call_soon(chunk_texts, self._engine.runtime, chunk_ids, self.caller.scope)

    def prompt_for(self, question: str, settings: AskSettings):
        """The prompt `settings` (from `ask_settings`) lays out for `question`, from the store's
        newest generation (the vLLM front's: vLLM generates)."""
        self._engine.refresh()
        return self._engine.prompt_for(question, settings)

    def conversation(self, conversations, history: list[tuple[str, str]], settings: AskSettings):
        """The conversation a chat turn continues: kept for this store and scope, or new
        (`ragkv.serve.conversations.Conversations.take`); and whether it was kept."""
        return conversations.take(self._engine, self.name, history, settings)

    def record(self, route: str, chunks, prompt_tokens: int = 0, completion_tokens: int = 0, cached: int = 0) -> None:
        """The use, in the audit log: the caller, this store and the (doc id, chunk id) `chunks`."""
        self._audit.record(route, self.caller, [self.name], chunks, prompt_tokens, completion_tokens, cached)


class Stores:
    """The served stores' engines by name, in the order given (the first is the default), and
    what opening one for a caller needs: the audit log and the server's settings."""

    def __init__(self, engines: Mapping[str, Any], audit, settings: ServeSettings):
        self._engines: dict[str, Any] = dict(engines)
        self._audit, self._settings = audit, settings
        self.first = next(iter(self._engines.values()))
        self.llm_name: str = self.first.lm.facts.name

    def open(self, model: str | None, caller: Caller) -> StoreHandle:
        """The handle on the store `model` names, for `caller`. No model, "ragkv" or the LLM's
        name: the caller's first store. UnknownModel otherwise, and for a store it may not use,
        alike."""
        allowed = self.names(caller)
        if model not in allowed:
            if not ((model is None or model in (SERVED_MODEL_ID, self.llm_name)) and allowed):
                raise UnknownModel(str(model), allowed)
            model = allowed[0]
        return StoreHandle(model, self._engines[model], caller, self._audit, self._settings)

    def names(self, caller: Caller) -> list[str]:
        return [name for name in self._engines if caller.may_use(name)]

    def listing(self, caller: Caller) -> dict:
        """What /v1/models answers `caller`: its stores, each with the LLM behind it as its root."""
        return {
            "object": "list",
            "data": [
                {"id": name, "object": "model", "created": 0, "owned_by": "ragkv", "root": self.llm_name}
                for name in self.names(caller)
            ],
        }

    def generation(self) -> int:
        """The first store's published generation (what /healthz reports)."""
        return self.first.snapshot.generation

    def engines(self) -> list:
        """Every store's engine, for the server's own work (metrics, refresh, flush): not a route's."""
        return list(self._engines.values())

    def start_stepping(self, settings: ServeSettings, before_admit):
        """The first store's engine stepping on a background thread (every store's requests join
        it), calling `before_admit` before it admits new requests; returns it."""
        stepped = self.first.engine
        stepped.start(settings.batch, before_admit=before_admit)
        return stepped


def front_block(prompt, warnings: list[str]) -> dict:
    """The vLLM front's reply `ragkv` block: sources, stats (of the retrieval: vLLM generates)
    and prompt size."""
    stats = Stats.of("exact", prompt)  # vLLM loads the stored KV at its own positions: exact
    sources = [Source.of(r, score) for r, score in prompt.retrieved]
    return reply(sources, stats, warnings, prompt_tokens=len(prompt.prompt_ids))


def layout_params(prompt, settings: ServeSettings) -> dict:
    """What the connector needs to know of the prompt's layout (ragkv.integrations.store_match):
    its chunks in order, and whether to store the KV vLLM computes of the leading ones the
    store lacks (a chunk alone, or the leading span's missing chunks, as ragkv's own engine
    does on a miss)."""
    rows = [row for row, _ in prompt.retrieved]
    leading = rows[:1]
    for row in rows[1:]:
        if not continues_span(leading[-1], row):
            break
        leading.append(row)
    miss = bool(leading) and not leading[0].live and any(row.entry is None for row in leading)
    return {
        "ragkv": {
            "chunks": [
                [row.chunk_id, len(ids)] for (row, _), ids in zip(prompt.retrieved, prompt.chunk_ids, strict=False)
            ],
            "write_back": bool(settings.write_back and miss),
        }
    }
