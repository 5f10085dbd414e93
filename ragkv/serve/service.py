"""`ragkv serve`: an OpenAI-compatible RAG endpoint that keeps the model, the store and hot KV
warm. FastAPI + uvicorn; model work runs on the engine's background thread (`ragkv.engine.engine`),
which decodes every active request together, one token per forward (continuous batching): new
requests join at the next step, finished or disconnected ones leave at once, and a long
prefill is split into chunks so running streams keep flowing. A bounded number of requests
may wait to be admitted (beyond that: 503 with Retry-After).

    POST /v1/chat/completions   OpenAI chat completions (stream or not), plus a `ragkv` block
    POST /v1/retrieve           question -> chunks and scores
    GET  /v1/models, /healthz, /metrics (Prometheus text)
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.responses import PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ragkv.core.config import AskSettings
from ragkv.core.errors import RagkvError
from ragkv.core.keys import digest
from ragkv.core.lru import ByteLRU
from ragkv.engine.engine import Engine
from ragkv.engine.scheduler import BatchSettings, Busy
from ragkv.serve.api import (
    DONE_EVENT,
    SERVED_MODEL_ID,
    ChatRequest,
    RetrieveRequest,
    ServeSettings,
    UnknownModel,
    chunk_event,
    completion,
    error_event,
    install_errors,
    json_error,
    max_tokens,
    models_listing,
    run_server,
    split_messages,
)
from ragkv.serve.guard import RequestGuard, backstop_concurrency
from ragkv.store.kv.writeback import FoldLoop

log = logging.getLogger("ragkv")


# -- conversations -------------------------------------------------------------------------
def _history_key(messages: list[tuple[str, str]]) -> str:
    return digest("ragkv-chat", json.dumps(messages))


class Conversations:
    """The KV of recent conversations, keyed by their messages, so that a follow-up request
    that repeats the history prefills only its new message. Bounded in bytes."""

    def __init__(self, engine, max_bytes: int):
        self.engine = engine
        self._lru: ByteLRU = ByteLRU(max_bytes)

    def take(self, history: list[tuple[str, str]], settings: AskSettings):
        """A conversation holding `history` ((user, assistant) pairs): a kept one when the
        history matches, else a new one that replays it."""
        kept = self._lru.pop(_history_key(history)) if history else None
        if kept is not None:
            return kept, True
        return self.engine.conversation(settings, history), False

    def keep(self, conversation, history: list[tuple[str, str]]) -> None:
        size = conversation.runtime.lm.facts.kv_bytes_per_token * len(conversation.ids())
        self._lru.put(_history_key(history), conversation, size=size)


# -- the app -------------------------------------------------------------------------------
class Metrics:
    def __init__(self, engine, stepped: Engine, folding: FoldLoop | None = None):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("ragkv_requests", "HTTP requests", ["endpoint", "status"], registry=r)
        self.ttft = Histogram(
            "ragkv_ttft_seconds",
            "Time to first token",
            registry=r,
            buckets=(0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 12.8),
        )
        self.reused = Counter("ragkv_tokens_reused", "Prompt tokens whose KV came from the store", registry=r)
        self.computed = Counter("ragkv_tokens_computed", "Prompt tokens prefilled", registry=r)
        self.generated = Counter("ragkv_tokens_generated", "Answer tokens", registry=r)
        self.cancelled = Counter(
            "ragkv_requests_cancelled",
            "Requests whose client went away before the answer ended (their rows leave the batch at the next step)",
            registry=r,
        )
        tier = engine.ram
        Gauge("ragkv_ram_tier_bytes", "Bytes of chunk KV in the RAM tier", registry=r).set_function(lambda: tier.bytes)
        Gauge("ragkv_ram_tier_entries", "Chunk KV entries in the RAM tier (which: /v1/cache)", registry=r).set_function(
            lambda: len(tier)
        )
        Gauge("ragkv_ram_tier_hits", "RAM tier hits", registry=r).set_function(lambda: tier.hits)
        Gauge("ragkv_ram_tier_misses", "RAM tier misses", registry=r).set_function(lambda: tier.misses)
        Gauge("ragkv_store_generation", "Store generation being served", registry=r).set_function(
            lambda: engine.snapshot.generation
        )
        Gauge("ragkv_batch_running", "Requests in the running batch (decoding or prefilling)", registry=r).set_function(
            lambda: stepped.num_running
        )
        Gauge("ragkv_requests_waiting", "Requests waiting to join the batch", registry=r).set_function(
            lambda: stepped.num_waiting
        )
        Gauge(
            "ragkv_tokens_per_second", "Answer tokens generated per second over the last 10 s", registry=r
        ).set_function(stepped.tokens_per_s)
        loader = engine.loader
        Gauge(
            "ragkv_pending_dropped", "Computed KV entries dropped to stay within --pending-bytes (S3)", registry=r
        ).set_function(loader.pending_dropped)
        Gauge(
            "ragkv_pending_uploaded_bytes", "Bytes left pending for the writer's fold (S3): KV and uses", registry=r
        ).set_function(loader.pending_uploaded)
        if folding is not None:
            Gauge("ragkv_folds", "Folds this writer replica published", registry=r).set_function(lambda: folding.folds)

    def record(self, stats) -> None:
        self.ttft.observe(stats.ttft_s)
        self.reused.inc(stats.reused_tokens)
        self.computed.inc(stats.computed_tokens + stats.recomputed_tokens)
        self.generated.inc(stats.generated_tokens)


def build_app(engine, settings: ServeSettings) -> FastAPI:
    """The service's app over `engine`: its scheduler steps on a background thread until the
    app's lifespan ends."""
    stepped = _start_engine(engine, settings)
    folding = FoldLoop(engine.snapshot.location, settings.fold_every_s).start() if settings.writer else None

    @asynccontextmanager
    async def lifespan(app):
        yield
        stepped.stop()  # finishes what is queued
        # Now, not when `ragkv.open`'s block ends: after a SIGTERM uvicorn raises the signal
        # again once it has shut down, which ends the process before that.
        engine.flush()  # the KV computed on misses, and (on S3) the uses logged
        if folding is not None:
            folding.stop()

    app = FastAPI(title="ragkv", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    metrics = Metrics(engine, stepped, folding)
    app.state.stepped, app.state.folding = stepped, folding

    app.add_middleware(
        RequestGuard,
        max_body_bytes=settings.max_body_bytes,
        count=lambda route, status: metrics.requests.labels(route, str(status)).inc(),
        max_in_flight=max_in_flight(settings),
    )

    authorised = install_errors(app, settings, engine.lm.facts.name)

    @app.exception_handler(Busy)
    async def busy(request, exc):
        return json_error(503, "the model is busy; retry shortly", "server_busy", headers={"Retry-After": "1"})

    _add_info_routes(app, engine, stepped, metrics, authorised)
    _add_chat_route(app, engine, settings, metrics, authorised)
    return app


def _start_engine(engine, settings: ServeSettings) -> Engine:
    """The engine's scheduler stepping on a background thread, moving to the store's newest
    published generation before it admits new requests."""

    def refresh() -> None:
        try:
            engine.refresh()
        except RagkvError as exc:  # keep serving the generation we have
            log.warning("not switching store generation: %s", exc)

    stepped: Engine = engine.engine
    stepped.start(
        BatchSettings(
            max_batch=settings.max_batch,
            max_batch_tokens=settings.max_batch_tokens,
            prefill_chunk=settings.prefill_chunk,
            max_queue=settings.max_queue,
        ),
        before_admit=refresh,
    )
    return stepped


def _add_chat_route(app: FastAPI, engine, settings: ServeSettings, metrics: Metrics, authorised) -> None:
    stepped: Engine = engine.engine
    conversations = Conversations(engine, settings.conversation_bytes)
    model_id = SERVED_MODEL_ID  # one id for the RAG service; the LLM behind it is its "root"
    accepted_ids = {SERVED_MODEL_ID, engine.lm.facts.name}

    @app.post("/v1/chat/completions", dependencies=[Depends(authorised)])
    async def chat(body: ChatRequest, request: Request):
        if body.model is not None and body.model not in accepted_ids:
            raise UnknownModel(body.model)
        history, question, warnings = split_messages(body.messages)
        ask = body.ask_settings(max_tokens(body, settings, warnings))
        created, reply_id = int(time.time()), f"chatcmpl-{uuid.uuid4().hex}"
        if not body.stream:
            queued, opened = _submit(stepped, conversations, history, question, ask)
            try:
                answer = await _unless_disconnected(request, queued)
            finally:
                queued.cancel()  # a client that went away frees its row (no-op once answered)
            if answer.stats.finish_reason == "cancelled":
                metrics.cancelled.inc()
            metrics.record(answer.stats)
            return _completion(reply_id, created, model_id, answer, warnings, opened["reused"])
        # Queued before the response starts, so a full queue is a 503 with Retry-After, not an event in a 200.
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[object] = asyncio.Queue()
        queued, opened = _submit(
            stepped,
            conversations,
            history,
            question,
            ask,
            on_text=lambda text: loop.call_soon_threadsafe(queue.put_nowait, text),
        )
        return StreamingResponse(
            _stream(queued, opened, queue, reply_id, created, model_id, warnings, metrics),
            media_type="text/event-stream",
        )


def serve(engine, store: str, settings: ServeSettings, announce) -> None:
    """`ragkv serve`: the app on uvicorn until interrupted; `announce` gets the line saying where."""
    app = build_app(engine, settings)
    line = f"ragkv serving {store} ({engine.lm.facts.name}) on http://{settings.host}:{settings.port}"
    run_server(app, settings, announce, line, limit_concurrency=backstop_concurrency(max_in_flight(settings)))


def max_in_flight(settings: ServeSettings) -> int:
    """Requests the service holds at once (queued, running, or being read or streamed) before it
    answers 503 with Retry-After: room for the queue several times over."""
    return settings.max_queue * 4 + 16


def _add_info_routes(app: FastAPI, engine, stepped: Engine, metrics: Metrics, authorised) -> None:
    @app.get("/healthz")
    async def healthz():
        return {
            "status": "ok",
            "generation": engine.snapshot.generation,
            "model": SERVED_MODEL_ID,
            "running": stepped.num_running,
            "waiting": stepped.num_waiting,
        }

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(generate_latest(metrics.registry).decode(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", dependencies=[Depends(authorised)])
    async def models():
        return models_listing(engine.lm.facts.name)

    @app.get("/v1/cache", dependencies=[Depends(authorised)])
    async def cache():
        """What this replica holds hot (its RAM tier's chunks): for a router that sends a
        document's questions where its KV is warm."""
        return await asyncio.wrap_future(stepped.call_soon(engine.loader.hot))

    @app.post("/v1/retrieve", dependencies=[Depends(authorised)])
    async def retrieve(body: RetrieveRequest):
        settings = body.settings()
        found = await asyncio.wrap_future(engine.search_soon(body.query, settings))
        return {
            "object": "list",
            "data": [result.to_dict() for result in found],
            "retrieval": found.retrieval,
            "warnings": found.warnings,
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


def _submit(stepped: Engine, conversations: Conversations, history, question: str, settings: AskSettings, on_text=None):
    """Queue a turn: the kept conversation holding `history` (or a new one replaying it) is
    opened on the model thread when the turn is admitted, and kept again once answered.
    Returns the engine's request (ragkv.engine.request) and a dict whose "reused" says whether a
    kept conversation served."""
    opened = {"reused": False, "conversation": None}

    def open_conversation():
        opened["conversation"], opened["reused"] = conversations.take(history, settings)
        return opened["conversation"]

    queued = stepped.submit(open_conversation, question, settings.max_new_tokens, settings.decoding, on_text)

    def keep(future) -> None:  # on the model thread, like `take`
        if not future.cancelled() and future.exception() is None and future.result().stats.finish_reason != "cancelled":
            conversations.keep(opened["conversation"], [*history, (question, future.result().text)])

    queued.future.add_done_callback(keep)
    return queued, opened


def _ragkv_block(answer, warnings: list[str], reused_history: bool) -> dict:
    return answer.reply(warnings, conversation_reused=reused_history)


def _usage(answer) -> dict:
    prompt = answer.stats.prompt_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": len(answer.token_ids),
        "total_tokens": prompt + len(answer.token_ids),
    }


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


async def _stream(queued, opened, queue: asyncio.Queue, reply_id, created, model_id, warnings, metrics):
    """Server-sent events in OpenAI's chunk format for a submitted turn, which decodes in the
    running batch on the model thread and hands its text over through `queue`. A client that
    disconnects cancels it."""

    def chunk(delta: dict, finish: str | None = None, **extra) -> str:
        return chunk_event(reply_id, created, model_id, delta, finish, **extra)

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
        yield chunk(
            {},
            answer.stats.finish_reason or "stop",
            usage=_usage(answer),
            ragkv=_ragkv_block(answer, warnings, opened["reused"]),
        )
        yield DONE_EVENT
    finally:
        if not job.done():
            metrics.cancelled.inc()
        queued.cancel()  # the client went away mid-stream: its row leaves at the next step
