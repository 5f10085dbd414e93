"""`ragkv serve`: an OpenAI-compatible RAG endpoint that keeps the model, the store and hot KV
warm. FastAPI + uvicorn; model work runs on one thread (`ragkv.scheduler.Batcher`), which
decodes every active request together, one token per forward (continuous batching): new
requests join at the next step, finished or disconnected ones leave at once, and a long
prefill is split into chunks so running streams keep flowing. A bounded number of requests
may wait to be admitted (beyond that: 503 with Retry-After).

    POST /v1/chat/completions   OpenAI chat completions (stream or not), plus a `ragkv` block
    POST /v1/retrieve           question -> chunks and scores
    GET  /v1/models, /healthz, /metrics (Prometheus text)
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from typing import Literal

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from ragkv.config import DEFAULT_NO_REPEAT_NGRAM, DEFAULT_REPETITION_PENALTY, MAX_SEED, AskSettings, DecodeSettings
from ragkv.errors import InputError, ModelError, RagkvError, StoreEmptyError
from ragkv.guard import BodyTooLarge, RequestGuard
from ragkv.keys import digest
from ragkv.lru import ByteLRU
from ragkv.scheduler import BatchSettings, Batcher, Busy
from ragkv.text import check_text

log = logging.getLogger("ragkv")


@dataclass(frozen=True)
class ServeSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    max_tokens_cap: int = 1024  # a request's max_tokens is cut to this
    default_max_tokens: int = 256
    max_queue: int = 16  # requests that may wait to be admitted; more get 503
    max_batch: int = 16  # requests decoded together (continuous batching)
    max_batch_tokens: int = 32768  # KV tokens the running batch may hold (rows x longest prompt + answer)
    prefill_chunk: int = 256  # prompt tokens one request prefills per step (the others keep decoding)
    conversation_bytes: int = 512 << 20  # KV of recent conversations kept for their next turn
    shutdown_grace_s: int = 10  # on SIGTERM, requests still running after this long are cut off
    write_back: bool = True  # store KV computed for a chunk the store lacks (within the budget)

    def __post_init__(self):
        for name in ("max_queue", "max_batch", "max_tokens_cap", "max_batch_tokens", "prefill_chunk"):
            if getattr(self, name) < 1:
                raise InputError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if not 0 <= self.port <= 65535:  # checked before the model loads
            raise InputError(f"--port must be a TCP port from 0 to 65535, got {self.port}")


# -- request bodies ------------------------------------------------------------------------
class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields ragkv does not use


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class RagkvOptions(_Body):
    model_config = ConfigDict(extra="forbid")
    top_k: int = Field(1, ge=1, le=50)
    repetition_penalty: float = Field(DEFAULT_REPETITION_PENALTY, ge=1.0, le=10.0)
    no_repeat_ngram: int = Field(DEFAULT_NO_REPEAT_NGRAM, ge=0, le=64)
    mode: Literal["exact", "approximate", "concat", "blend", "epic"] = "exact"  # ape: not batched
    context: Literal["chunk", "span", "document"] = "span"
    no_cache: bool = False
    doc_ids: list[str] | None = Field(None, max_length=100)


class ChatRequest(_Body):
    model: str | None = None
    messages: list[Message] = Field(min_length=1, max_length=200)
    stream: bool = False
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(0.0, ge=0.0, le=5.0)  # 0 (the default here): greedy
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = Field(None, max_length=16)
    ragkv: RagkvOptions = Field(default_factory=RagkvOptions)


class RetrieveRequest(_Body):
    query: str = Field(min_length=1, max_length=20_000)
    top_k: int = Field(5, ge=1, le=100)
    doc_ids: list[str] | None = Field(None, max_length=100)


# -- errors --------------------------------------------------------------------------------
def json_error(status: int, message: str, kind: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status, headers=headers)


SERVED_MODEL_ID = "ragkv"  # what /v1/models lists and replies name; requests may also name the LLM itself
_STATUS = {InputError: 400, StoreEmptyError: 404, ModelError: 409}


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
        conversation = self.engine.conversation(settings)
        for user, assistant in history:
            conversation.replay(user, assistant)
        return conversation, False

    def keep(self, conversation, history: list[tuple[str, str]]) -> None:
        size = conversation.runtime.lm.facts.kv_bytes_per_token * len(conversation.ids())
        self._lru.put(_history_key(history), conversation, size=size)


# -- the app -------------------------------------------------------------------------------
class Metrics:
    def __init__(self, engine, batcher):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("ragkv_requests", "HTTP requests", ["endpoint", "status"], registry=r)
        self.ttft = Histogram("ragkv_ttft_seconds", "Time to first token", registry=r,
                              buckets=(0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 12.8))
        self.reused = Counter("ragkv_tokens_reused", "Prompt tokens whose KV came from the store", registry=r)
        self.computed = Counter("ragkv_tokens_computed", "Prompt tokens prefilled", registry=r)
        self.generated = Counter("ragkv_tokens_generated", "Answer tokens", registry=r)
        self.cancelled = Counter("ragkv_requests_cancelled", "Requests whose client went away before the answer ended "
                                 "(their rows leave the batch at the next step)", registry=r)
        tier = engine.ram
        Gauge("ragkv_ram_tier_bytes", "Bytes of chunk KV in the RAM tier", registry=r).set_function(lambda: tier.bytes)
        Gauge("ragkv_ram_tier_hits", "RAM tier hits", registry=r).set_function(lambda: tier.hits)
        Gauge("ragkv_ram_tier_misses", "RAM tier misses", registry=r).set_function(lambda: tier.misses)
        Gauge("ragkv_store_generation", "Store generation being served", registry=r).set_function(
            lambda: engine.snapshot.generation)
        Gauge("ragkv_batch_running", "Requests in the running batch (decoding or prefilling)",
              registry=r).set_function(lambda: batcher.num_running)
        Gauge("ragkv_requests_waiting", "Requests waiting to join the batch", registry=r).set_function(
            lambda: batcher.num_waiting)
        Gauge("ragkv_tokens_per_second", "Answer tokens generated per second over the last 10 s",
              registry=r).set_function(batcher.tokens_per_s)

    def record(self, stats) -> None:
        self.ttft.observe(stats.ttft_s)
        self.reused.inc(stats.reused_tokens)
        self.computed.inc(stats.computed_tokens + stats.recomputed_tokens)
        self.generated.inc(stats.generated_tokens)


def build_app(engine, settings: ServeSettings) -> FastAPI:
    conversations = Conversations(engine, settings.conversation_bytes)

    def refresh() -> None:  # before admitting new requests: the newest published generation
        try:
            engine.refresh()
        except RagkvError as exc:  # keep serving the generation we have
            log.warning("not switching store generation: %s", exc)

    batcher = Batcher(engine.runtime, BatchSettings(max_batch=settings.max_batch, max_batch_tokens=settings.max_batch_tokens,
                                            prefill_chunk=settings.prefill_chunk, max_queue=settings.max_queue),
                      before_admit=refresh)

    @asynccontextmanager
    async def lifespan(app):
        yield
        batcher.close()

    app = FastAPI(title="ragkv", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    metrics = Metrics(engine, batcher)
    model_id = SERVED_MODEL_ID  # one id for the RAG service; the LLM behind it is its "root"
    accepted_ids = {SERVED_MODEL_ID, engine.lm.facts.name}
    app.state.batcher = batcher

    app.add_middleware(RequestGuard, max_body_bytes=settings.max_body_bytes,
                       count=lambda route, status: metrics.requests.labels(route, str(status)).inc())

    authorised = install_errors(app, settings, engine.lm.facts.name)

    @app.exception_handler(Busy)
    async def busy(request, exc):
        return json_error(503, "the model is busy; retry shortly", "server_busy", headers={"Retry-After": "1"})

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok", "generation": engine.snapshot.generation, "model": model_id,
                "running": batcher.num_running, "waiting": batcher.num_waiting}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(generate_latest(metrics.registry).decode(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", dependencies=[Depends(authorised)])
    async def models():
        return models_listing(engine.lm.facts.name)

    @app.post("/v1/retrieve", dependencies=[Depends(authorised)])
    async def retrieve(body: RetrieveRequest):
        hits = await asyncio.wrap_future(batcher.call(engine.retrieve, body.query, body.top_k, body.doc_ids))
        return {"object": "list", "data": [
            {"chunk_id": row.chunk_id, "doc_id": row.doc_id, "source": row.source, "chunk_index": row.chunk_index,
             "score": score, "text": row.text} for row, score in hits]}

    @app.post("/v1/chat/completions", dependencies=[Depends(authorised)])
    async def chat(body: ChatRequest, request: Request):
        if body.model is not None and body.model not in accepted_ids:
            raise UnknownModel(body.model)
        history, question, warnings = split_messages(body.messages)
        requested = body.max_completion_tokens or body.max_tokens or settings.default_max_tokens
        if requested > settings.max_tokens_cap:
            warnings.append(f"max_tokens cut from {requested} to {settings.max_tokens_cap}")
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        decoding = DecodeSettings(repetition_penalty=body.ragkv.repetition_penalty,
                                  no_repeat_ngram=body.ragkv.no_repeat_ngram, temperature=body.temperature,
                                  top_p=body.top_p, seed=body.seed, stop=stop)
        ask = AskSettings(top_k=body.ragkv.top_k, mode=body.ragkv.mode, context=body.ragkv.context,
                          use_cache=not body.ragkv.no_cache,
                          max_new_tokens=min(requested, settings.max_tokens_cap),
                          doc_ids=tuple(body.ragkv.doc_ids) if body.ragkv.doc_ids is not None else None,
                          decoding=decoding)
        created, reply_id = int(time.time()), f"chatcmpl-{uuid.uuid4().hex}"
        if not body.stream:
            ticket, opened = _submit(batcher, conversations, history, question, ask)
            try:
                answer = await _unless_disconnected(request, ticket)
            finally:
                ticket.cancel()  # a client that went away frees its row (no-op once answered)
            if answer.stats.finish_reason == "cancelled":
                metrics.cancelled.inc()
            metrics.record(answer.stats)
            return _completion(reply_id, created, model_id, answer, warnings, opened["reused"])
        # Queued before the response starts, so a full queue is a 503 with Retry-After, not an event in a 200.
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        ticket, opened = _submit(batcher, conversations, history, question, ask,
                                 on_text=lambda text: loop.call_soon_threadsafe(queue.put_nowait, text))
        return StreamingResponse(_stream(ticket, opened, queue, reply_id, created, model_id, warnings, metrics),
                                 media_type="text/event-stream")

    return app


async def _unless_disconnected(request: Request, ticket):
    """The ticket's answer; if the client disconnects first, the turn is cancelled (its row leaves
    at the next step) and its end is awaited. Waits on the disconnect message itself, no polling."""
    job = asyncio.wrap_future(ticket.future)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({job, watch}, return_when=asyncio.FIRST_COMPLETED)
        if job not in done:
            ticket.cancel()
        return await job
    finally:
        watch.cancel()


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (the body is already read: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def models_listing(llm_name: str) -> dict:
    """What /v1/models answers: the RAG service's one id, the LLM behind it as its root."""
    return {"object": "list", "data": [{"id": SERVED_MODEL_ID, "object": "model", "created": 0, "owned_by": "ragkv",
                                        "root": llm_name}]}


def install_errors(app: FastAPI, settings: ServeSettings, llm_name: str):
    """JSON errors for bad bodies, ragkv errors, unknown models and a wrong API key; returns
    the dependency that checks the key."""

    async def authorised(request: Request) -> None:
        if settings.api_key is None:
            return
        sent = request.headers.get("authorization", "")
        if not hmac.compare_digest(sent.encode(), f"Bearer {settings.api_key}".encode()):
            raise _Unauthorised()

    @app.exception_handler(_Unauthorised)
    async def unauthorised(request, exc):
        return json_error(401, "missing or wrong API key: send Authorization: Bearer KEY", "invalid_api_key")

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc):
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            return json_error(400, "the request body is not valid JSON", "invalid_request_error")
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or "body"
        return json_error(400, f"invalid request: {where}: {first.get('msg', 'malformed')}", "invalid_request_error")

    @app.exception_handler(RagkvError)
    async def ragkv_error(request, exc):
        status = next((code for kind, code in _STATUS.items() if isinstance(exc, kind)), 500)
        return json_error(status, str(exc), type(exc).__name__)

    @app.exception_handler(BodyTooLarge)
    async def too_large(request, exc):
        return json_error(413, exc.detail, "request_too_large", headers={"Connection": "close"})

    @app.exception_handler(Exception)
    async def internal(request, exc):  # a bug: the client still gets the JSON error shape (uvicorn logs the traceback)
        log.error("request to %s failed: %r", request.url.path, exc)
        return json_error(500, f"internal error: {type(exc).__name__}", "internal_error")

    @app.exception_handler(UnknownModel)
    async def unknown_model(request, exc):
        return json_error(404, f"the model {exc.args[0]!r} does not exist; this service serves {SERVED_MODEL_ID!r} "
                           f"(the LLM {llm_name})", "model_not_found")

    return authorised


class _Unauthorised(Exception):
    pass


class UnknownModel(Exception):
    pass


def split_messages(messages: list[Message]) -> tuple[list[tuple[str, str]], str, list[str]]:
    """(earlier (user, assistant) pairs, the last user message, warnings) from chat messages."""
    warnings = []
    if any(m.role in ("system", "developer") for m in messages):
        warnings.append("system messages are ignored: the store's system prompt is part of its cache keys")
    for number, message in enumerate(messages):
        check_text(message.text, f"message {number}")
    turns = [m for m in messages if m.role in ("user", "assistant")]
    if not turns or turns[-1].role != "user" or not turns[-1].text.strip():
        raise InputError("the last message must be a user message with text")
    history, pending_user = [], None
    for message in turns[:-1]:
        if message.role == "user":
            if pending_user is not None:
                raise InputError("user messages must alternate with assistant messages")
            pending_user = message.text
        else:
            if pending_user is None:
                raise InputError("an assistant message must follow a user message")
            history.append((pending_user, message.text))
            pending_user = None
    if pending_user is not None:
        raise InputError("user messages must alternate with assistant messages")
    return history, turns[-1].text, warnings


def _submit(batcher: Batcher, conversations: Conversations, history, question: str, settings: AskSettings,
            on_text=None):
    """Queue a turn: the kept conversation holding `history` (or a new one replaying it) is
    opened on the model thread when the turn is admitted, and kept again once answered.
    Returns the Ticket and a dict whose "reused" says whether a kept conversation served."""
    opened = {"reused": False, "conversation": None}

    def open_conversation():
        opened["conversation"], opened["reused"] = conversations.take(history, settings)
        return opened["conversation"]

    ticket = batcher.submit(open_conversation, question, settings.max_new_tokens, settings.decoding, on_text)

    def keep(future) -> None:  # on the model thread, like `take`
        if not future.cancelled() and future.exception() is None and future.result().stats.finish_reason != "cancelled":
            conversations.keep(opened["conversation"], [*history, (question, future.result().text)])

    ticket.future.add_done_callback(keep)
    return ticket, opened


def _ragkv_block(answer, warnings: list[str], reused_history: bool) -> dict:
    return {"sources": [asdict(s) for s in answer.sources],
            "stats": {**answer.stats.to_dict(), "warnings": answer.stats.warnings + warnings},
            "token_ids": answer.token_ids,
            "conversation_reused": reused_history}


def _usage(answer) -> dict:
    prompt = answer.stats.prompt_tokens
    return {"prompt_tokens": prompt, "completion_tokens": len(answer.token_ids),
            "total_tokens": prompt + len(answer.token_ids)}


def _completion(reply_id, created, model_id, answer, warnings, reused_history) -> dict:
    return {"id": reply_id, "object": "chat.completion", "created": created, "model": model_id,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": answer.text},
                         "finish_reason": answer.stats.finish_reason or "stop"}],
            "usage": _usage(answer), "ragkv": _ragkv_block(answer, warnings, reused_history)}


async def _stream(ticket, opened, queue: asyncio.Queue, reply_id, created, model_id, warnings, metrics):
    """Server-sent events in OpenAI's chunk format for a submitted turn, which decodes in the
    running batch on the model thread and hands its text over through `queue`. A client that
    disconnects cancels it."""

    def chunk(delta: dict, finish: str | None = None, **extra) -> str:
        body = {"id": reply_id, "object": "chat.completion.chunk", "created": created, "model": model_id,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}
        return f"data: {json.dumps(body)}\n\n"

    job = asyncio.wrap_future(ticket.future)
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
            yield f"data: {json.dumps({'error': {'message': str(exc), 'type': type(exc).__name__}})}\n\n"
            return
        except Exception as exc:  # a bug: the client still gets a last event and the stream ends
            log.error("request failed: %r", exc)
            yield f"data: {json.dumps({'error': {'message': f'internal error: {exc!r}', 'type': 'internal_error'}})}\n\n"
            return
        metrics.record(answer.stats)
        yield chunk({}, answer.stats.finish_reason or "stop", usage=_usage(answer),
                    ragkv=_ragkv_block(answer, warnings, opened["reused"]))
        yield "data: [DONE]\n\n"
    finally:
        if not job.done():
            metrics.cancelled.inc()
        ticket.cancel()  # the client went away mid-stream: its row leaves at the next step
