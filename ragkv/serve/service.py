"""`ragkv serve`: an OpenAI-compatible RAG endpoint that keeps the model, the store and hot KV
warm. FastAPI + uvicorn; model work runs on the engine's background thread (`ragkv.engine.engine`),
which decodes every active request together, one token per forward (continuous batching): new
requests join at the next step, finished or disconnected ones leave at once, and a long
prefill is split into chunks so running streams keep flowing. A bounded number of requests
may wait to be admitted (beyond that: 503 with Retry-After).

Several stores can be served by name on one loaded model (`--store NAME=PATH`, picked by the
request's `model`), and API keys can carry scopes (`--keys`, ragkv.serve.api_keys): every route
retrieves within the caller's scope and answers from its stores only (ragkv.serve.access).

    POST /v1/chat/completions   OpenAI chat completions (stream or not), plus a `ragkv` block
    POST /v1/retrieve           question -> chunks and scores
    GET  /v1/models, /v1/cache, /healthz, /metrics (Prometheus text)
    GET  /ui (the dashboard; ragkv.serve.ui)
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
import uuid
from collections.abc import Mapping
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import PlainTextResponse, StreamingResponse
from prometheus_client import generate_latest

from ragkv.core.config import AskSettings
from ragkv.core.errors import RagkvError
from ragkv.serve.access import SERVED_MODEL_ID, Access
from ragkv.serve.api import (
    DONE_EVENT,
    ChatRequest,
    RetrieveRequest,
    ServeSettings,
    add_models_route,
    chunk_event,
    completion,
    error_event,
    healthz_body,
    install_errors,
    json_error,
    run_server,
    split_messages,
    usage,
)
from ragkv.serve.api_keys import Caller, KeyRing
from ragkv.serve.audit import open_audit
from ragkv.serve.conversations import Conversations
from ragkv.serve.guard import RequestGuard, backstop_concurrency
from ragkv.serve.metrics import Metrics
from ragkv.serve.stores import Busy, StoreHandle, Stores
from ragkv.serve.ui import Sampler, add_ui_routes
from ragkv.store.kv.writeback import FoldLoop

log = logging.getLogger("ragkv")


def access_for(settings: ServeSettings) -> Access:
    """Who may call, per the settings: --keys (read now: a bad file stops the start), --api-key, or anyone."""
    return Access(settings.api_key, KeyRing(settings.keys_file) if settings.keys_file else None)


class Served:
    """What the routes share: the stores (opened for a caller: ragkv.serve.stores), who may
    call, the kept conversations and the audit log."""

    def __init__(self, engines: Mapping[str, Any], settings: ServeSettings, access: Access):
        self.settings = settings
        self.access = access
        self.conversations = Conversations(settings.conversation_bytes)
        self.audit = open_audit(settings.audit_log, settings.audit_max_bytes)
        self.stores = Stores(engines, self.audit, settings)

    def refresh(self) -> None:
        """Every store to its newest published generation (on the model thread, before admitting)."""
        for engine in self.stores.engines():
            try:
                engine.refresh()
            except RagkvError as exc:  # keep serving the generation we have
                log.warning("store %s: not switching generation: %s", engine.snapshot.location, exc)


def build_app(engine, settings: ServeSettings, access: Access | None = None) -> FastAPI:
    """The service's app over `engine` (a QueryEngine, or a mapping of store names to engines
    sharing the first one's model: `QueryEngine(share=)`): the first's scheduler steps on a
    background thread until the app's lifespan ends."""
    engines = engine if isinstance(engine, Mapping) else {SERVED_MODEL_ID: engine}
    served = Served(engines, settings, access or access_for(settings))
    stepped = served.stores.start_stepping(settings, served.refresh)
    first = served.stores.first
    folding = FoldLoop(first.snapshot.location, settings.fold_every_s).start() if settings.writer else None

    @asynccontextmanager
    async def lifespan(app):
        yield
        stepped.stop()  # finishes what is queued
        sampler.stop()
        # Now, not when `ragkv.open`'s block ends: after a SIGTERM uvicorn raises the signal
        # again once it has shut down, which ends the process before that.
        for each in served.stores.engines():
            each.flush()  # the KV computed on misses, and (on S3) the uses logged
        if folding is not None:
            folding.stop()
        served.audit.close()

    app = FastAPI(title="ragkv", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    metrics = Metrics(served.stores.engines(), stepped, folding)
    sampler = Sampler(metrics.registry).start()
    app.state.stepped, app.state.folding, app.state.access = stepped, folding, served.access

    app.add_middleware(
        RequestGuard,
        max_body_bytes=settings.max_body_bytes,
        count=lambda route, status: metrics.requests.labels(route, str(status)).inc(),
        max_in_flight=max_in_flight(settings),
    )
    install_errors(app)

    @app.exception_handler(Busy)
    async def busy(request, exc):
        return json_error(503, "the model is busy; retry shortly", "server_busy", headers={"Retry-After": "1"})

    _add_info_routes(app, served, stepped, metrics)
    _add_chat_route(app, served, stepped, metrics)
    add_ui_routes(app, served, stepped, sampler)
    return app


def _add_chat_route(app: FastAPI, served: Served, stepped, metrics: Metrics) -> None:
    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request, caller: Caller = Depends(served.access)):
        handle = served.stores.open(body.model, caller)
        history, question, warnings = split_messages(body.messages)
        ask = handle.ask_settings(body, warnings)
        created, reply_id = int(time.time()), f"chatcmpl-{uuid.uuid4().hex}"
        turn = ChatTurn(served, handle, history, question, ask)
        if not body.stream:
            queued = turn.submit(stepped)
            try:
                answer = await _unless_disconnected(request, queued)
            finally:
                queued.cancel()  # a client that went away frees its row (no-op once answered)
            if answer.stats.finish_reason == "cancelled":
                metrics.cancelled.inc()
            metrics.record(answer.stats)
            turn.audit(answer)
            return _completion(reply_id, created, handle.name, answer, warnings, turn.reused)
        # Queued before the response starts, so a full queue is a 503 with Retry-After, not an event in a 200.
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[object] = asyncio.Queue()
        queued = turn.submit(stepped, on_text=lambda text: loop.call_soon_threadsafe(queue.put_nowait, text))
        return StreamingResponse(
            _stream(queued, turn, queue, reply_id, created, warnings, metrics), media_type="text/event-stream"
        )


def serve(engine, store: str, settings: ServeSettings, announce) -> None:
    """`ragkv serve`: the app on uvicorn until interrupted; `announce` gets the line saying where.
    `engine`: one QueryEngine (served as "ragkv") or a mapping of store names to engines. With
    --keys, SIGHUP re-reads the keys file (requests in flight keep the keys they came with)."""
    app = build_app(engine, settings)
    engines = engine if isinstance(engine, Mapping) else {SERVED_MODEL_ID: engine}
    llm = next(iter(engines.values())).lm.facts.name
    line = f"ragkv serving {store} ({llm}) on http://{settings.host}:{settings.port}"
    reload_keys_on_sighup(app.state.access)
    run_server(app, settings, announce, line, limit_concurrency=backstop_concurrency(max_in_flight(settings)))


def reload_keys_on_sighup(access: Access) -> None:
    """SIGHUP re-reads the keys file (ragkv.serve.api_keys.KeyRing.reload), where there is one."""
    if access.keys is not None and hasattr(signal, "SIGHUP"):
        keys = access.keys
        signal.signal(signal.SIGHUP, lambda signum, frame: keys.reload())


def max_in_flight(settings: ServeSettings) -> int:
    """Requests the service holds at once (queued, running, or being read or streamed) before it
    answers 503 with Retry-After: room for the queue several times over."""
    return settings.batch.max_queue * 4 + 16


def _add_info_routes(app: FastAPI, served: Served, stepped, metrics: Metrics) -> None:
    @app.get("/healthz")
    async def healthz():
        return healthz_body(served.stores, running=stepped.num_running, waiting=stepped.num_waiting)

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(generate_latest(metrics.registry).decode(), media_type="text/plain; version=0.0.4")

    add_models_route(app, served.stores, served.access)

    @app.get("/v1/cache")
    async def cache(model: str | None = None, caller: Caller = Depends(served.access)):
        """What this replica holds hot (a store's RAM tier chunks): for a router that sends a
        document's questions where its KV is warm. It names documents, so a scoped key gets 403."""
        return await asyncio.wrap_future(served.stores.open(model, caller).hot_soon(stepped))

    @app.post("/v1/retrieve")
    async def retrieve(body: RetrieveRequest, caller: Caller = Depends(served.access)):
        handle = served.stores.open(body.model, caller)
        found = await asyncio.wrap_future(handle.search_soon(body.query, handle.search_settings(body)))
        handle.record("/v1/retrieve", [(r.doc_id, r.chunk_id) for r in found])
        return {
            "object": "list",
            "data": [result.to_dict() for result in found],
            "retrieval": found.retrieval,
            "warnings": found.warnings,
            "latency_ms": found.latency_ms,
        }


async def _unless_disconnected(request: Request, queued):
    """The queued's answer; if the client disconnects first, the turn is cancelled (its row leaves
    at the next step) and its end is awaited. Waits on the disconnect message itself, no polling."""
    job = asyncio.wrap_future(queued.future)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({job, watch}, return_when=asyncio.FIRST_COMPLETED)
        if job not in done:
            queued.cancel()
        return await job
    finally:
        watch.cancel()


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (the body is already read: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class ChatTurn:
    """One chat request's turn: the conversation it continues (a kept one, or a new one replaying
    its history over the caller's scope) opens on the model thread when the turn is admitted,
    and is kept again once answered."""

    def __init__(self, served: Served, handle: StoreHandle, history, question: str, ask: AskSettings):
        self.served, self.handle = served, handle
        self.history, self.question, self.ask = history, question, ask
        self.reused = False  # a kept conversation served
        self.conversation = None

    def submit(self, stepped, on_text=None):
        """Queue the turn; returns the engine's request (ragkv.engine.request)."""
        queued = stepped.submit(self._open, self.question, self.ask.max_new_tokens, self.ask.decoding, on_text)
        queued.future.add_done_callback(self._keep)
        return queued

    def _open(self):
        self.conversation, self.reused = self.handle.conversation(self.served.conversations, self.history, self.ask)
        return self.conversation

    def _keep(self, future) -> None:  # on the model thread, like `_open`
        if not future.cancelled() and future.exception() is None and future.result().stats.finish_reason != "cancelled":
            history = [*self.history, (self.question, future.result().text)]
            self.served.conversations.keep(self.conversation, self.handle.name, history, self.ask)

    def audit(self, answer) -> None:
        used = _usage(answer)
        self.handle.record(
            "/v1/chat/completions",
            [(s.doc_id, s.chunk_id) for s in answer.sources],
            used["prompt_tokens"],
            used["completion_tokens"],
            used["prompt_tokens_details"]["cached_tokens"],
        )


def _ragkv_block(answer, warnings: list[str], reused_history: bool) -> dict:
    return answer.reply(warnings, conversation_reused=reused_history)


def _usage(answer) -> dict:
    return usage(answer.stats.prompt_tokens, len(answer.token_ids), answer.stats.reused_tokens)


def _completion(reply_id, created, model_id, answer, warnings, reused_history) -> dict:
    return completion(
        reply_id,
        created,
        model_id,
        answer.text,
        answer.stats.finish_reason or "stop",
        _usage(answer),
        _ragkv_block(answer, warnings, reused_history),
    )


async def _stream(queued, turn: ChatTurn, queue: asyncio.Queue, reply_id, created, warnings, metrics):
    """Server-sent events in OpenAI's chunk format for a submitted turn, which decodes in the
    running batch on the model thread and hands its text over through `queue`. A client that
    disconnects cancels it."""

    def chunk(delta: dict, finish: str | None = None, **extra) -> str:
        return chunk_event(reply_id, created, turn.handle.name, delta, finish, **extra)

    job = asyncio.wrap_future(queued.future)
    try:
        yield chunk({"role": "assistant", "content": ""})
        while not (job.done() and queue.empty()):
            getter = asyncio.ensure_future(queue.get())
            done, _ = await asyncio.wait({getter, job}, return_when=asyncio.FIRST_COMPLETED)
            if getter in done:
                yield chunk({"content": getter.result()})
            else:
                getter.cancel()
        try:
            answer = job.result()
        except RagkvError as exc:
            yield error_event(str(exc), type(exc).__name__)
            return
        except Exception as exc:  # a bug: the client still gets a last event and the stream ends
            log.error("request failed: %r", exc)
            yield error_event(f"internal error: {exc!r}", "internal_error")
            return
        metrics.record(answer.stats)
        turn.audit(answer)
        yield chunk(
            {},
            answer.stats.finish_reason or "stop",
            usage=_usage(answer),
            ragkv=_ragkv_block(answer, warnings, turn.reused),
        )
        yield DONE_EVENT
    finally:
        if not job.done():
            metrics.cancelled.inc()
        queued.cancel()  # the client went away mid-stream: its row leaves at the next step
