"""What both OpenAI-compatible fronts share (`ragkv serve`'s own engine, ragkv.serve.service, and vLLM
behind ragkv, ragkv.serve.vllm_front): the settings, the request schemas, the JSON errors, chat
message parsing, and the reply and server-sent event formats."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Literal

from fastapi import Depends, FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from ragkv.core.config import (
    DEFAULT_NO_REPEAT_NGRAM,
    DEFAULT_REPETITION_PENALTY,
    DEFAULT_RERANK,
    DEFAULT_RETRIEVAL,
    KV_RERANKER,
    MAX_RERANK,
    MAX_SEED,
    MAX_TOP_K,
    AskSettings,
    BatchSettings,
    SearchSettings,
    parse_reranker,
)
from ragkv.core.errors import InputError, ModelError, RagkvError, StoreEmptyError
from ragkv.core.text import check_text
from ragkv.serve.access import SERVED_MODEL_ID, Forbidden, RateLimited, Unauthorised, UnknownModel
from ragkv.serve.api_keys import Caller
from ragkv.serve.guard import BodyTooLarge

__all__ = ["SERVED_MODEL_ID", "UnknownModel"]  # re-exported: both fronts name them from here

log = logging.getLogger("ragkv")

DONE_EVENT = "data: [DONE]\n\n"


@dataclass(frozen=True)
class ServeSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    max_tokens_cap: int = 1024  # a request's max_tokens is cut to this
    default_max_tokens: int = 256
    batch: BatchSettings = field(default_factory=BatchSettings)  # the engine's batch; more waiting: 503
    conversation_bytes: int = 512 << 20  # KV of recent conversations kept for their next turn
    shutdown_grace_s: int = 10  # on SIGTERM, requests still running after this long are cut off
    write_back: bool = True  # store KV computed for a chunk the store lacks (within the budget)
    pending_bytes: int = 1 << 30  # on a store this replica does not write (S3): its pending KV's bound
    leave_pending: bool = False  # on a folder too: leave computed KV pending, never take the store's lock
    writer: bool = False  # this replica folds what the others left pending, every fold_every_s
    fold_every_s: float = 60.0
    keys_file: str | None = None  # API keys with scopes (ragkv.serve.api_keys), re-read on SIGHUP
    audit_log: str | None = None  # JSON lines, one per answered request (ragkv.serve.audit); None: off
    audit_max_bytes: int = 100 << 20  # the audit log rotates past this (5 old files kept)
    isolate_tenants: bool = False  # also key the RAM tier of stored KV by tenant (and store no misses)
    rerankers: tuple[str, ...] = ()  # cross-encoders a request may name in ragkv.reranker (serve --reranker)

    def engine_options(self) -> dict:
        """What `ragkv.open` takes of these settings: how the engine learns from its misses."""
        return {
            # isolated tenants: a miss one computed must not become a store hit for another
            "write_back": self.write_back and not self.isolate_tenants,
            "pending_bytes": self.pending_bytes,
            "leave_pending": self.leave_pending,
            "isolate_tenants": self.isolate_tenants,
        }

    def __post_init__(self):
        if self.max_tokens_cap < 1:
            raise InputError(f"--max-tokens-cap must be at least 1, got {self.max_tokens_cap}")
        if self.fold_every_s <= 0:
            raise InputError(f"--fold-every must be more than 0 seconds, got {self.fold_every_s:g}")
        if not 0 <= self.port <= 65535:  # checked before the model loads
            raise InputError(f"--port must be a TCP port from 0 to 65535, got {self.port}")
        if self.api_key is not None and self.keys_file is not None:
            raise InputError(
                "give --keys or --api-key, not both (a key without filters in the keys file reads everything)"
            )


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
    mode: str = "exact"  # one of config.MODES, or "approximate"
    context: str = "span"  # one of config.CONTEXTS
    order: str = "retrieval"  # one of config.ORDERS
    no_cache: bool = False
    doc_ids: list[str] | None = Field(None, max_length=100)
    rerank: int = Field(DEFAULT_RERANK, ge=0, le=MAX_RERANK)  # candidates the model scores (0: off)
    reranker: str = Field(KV_RERANKER, max_length=1024)  # kv, or a cross-encoder the server offers (or kv+it)
    retrieval: str = DEFAULT_RETRIEVAL  # one of config.RETRIEVALS
    filters: list[str] = Field(default_factory=list, max_length=32)  # ragkv.core.filters' grammar, all must match


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

    def ask_settings(self, max_new_tokens: int) -> AskSettings:
        """The request as ragkv's settings, for both fronts: its `ragkv` options and OpenAI's
        sampling fields, generating at most `max_new_tokens` (see `max_tokens`). Checked where
        every front's are, in AskSettings (an InputError: a 400 naming the option)."""
        options = self.ragkv.model_dump()
        use_cache = not options.pop("no_cache")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return AskSettings.from_dict(
            {
                **options,
                "use_cache": use_cache,
                "max_new_tokens": max_new_tokens,
                "temperature": self.temperature,
                "top_p": self.top_p,
                "seed": self.seed,
                "stop": stop,
            }
        )


class RetrieveRequest(_Body):
    model: str | None = None  # the store to search (its name; default the caller's first)
    query: str = Field(min_length=1, max_length=20_000)
    top_k: int = Field(5, ge=1, le=MAX_TOP_K)
    retrieval: str = DEFAULT_RETRIEVAL  # one of config.RETRIEVALS (checked by SearchSettings)
    rerank: int = Field(0, ge=0, le=MAX_RERANK)  # score this many candidates with the model (0: off)
    reranker: str = Field(KV_RERANKER, max_length=1024)  # kv, or a cross-encoder the server offers (or kv+it)
    doc_ids: list[str] | None = Field(None, max_length=100)
    filters: list[str] = Field(default_factory=list, max_length=32)  # ragkv.core.filters' grammar, all must match

    def settings(self) -> SearchSettings:
        """As the search's settings (InputError, a 400, for a retrieval or filter it refuses)."""
        doc_ids = tuple(self.doc_ids) if self.doc_ids is not None else None
        return SearchSettings(
            self.top_k, self.retrieval, self.rerank, doc_ids, tuple(self.filters), reranker=self.reranker
        )


class ChunksRequest(_Body):
    model: str | None = None  # the store (its name; default the caller's first)
    chunk_ids: list[int] = Field(max_length=100)


def check_reranker(settings: ServeSettings, reranker: str) -> None:
    """InputError (a 400) for a `reranker` naming a cross-encoder this server does not offer: a
    client never makes the server load a model (or read a folder) it was not started with."""
    _, cross = parse_reranker(reranker)
    if cross is not None and cross not in settings.rerankers:
        offered = ", ".join(settings.rerankers) or "none (serve --reranker MODEL offers one)"
        raise InputError(f"ragkv.reranker: the cross-encoder {cross[:200]!r} is not offered here; offered: {offered}")


# -- errors --------------------------------------------------------------------------------
def json_error(status: int, message: str, kind: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status, headers=headers)


def run_server(app: FastAPI, settings: ServeSettings, announce, line: str, **options) -> None:
    """Serve `app` on uvicorn at the settings' address until interrupted (both fronts); `announce`
    gets `line` once the socket listens, not before, so a client that waits for the line can
    connect. `options`: more of uvicorn's settings."""
    import uvicorn

    class Announcing(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:
                announce(line)

    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level="warning",
        timeout_graceful_shutdown=settings.shutdown_grace_s,
        **options,
    )
    Announcing(config).run()


_STATUS = {InputError: 400, StoreEmptyError: 404, ModelError: 409}


def install_errors(app: FastAPI) -> None:
    """JSON errors for bad bodies, ragkv errors, unknown models, a wrong API key and a key past
    its rate (ragkv.serve.access)."""

    @app.exception_handler(Unauthorised)
    async def unauthorised(request, exc):
        return json_error(401, "missing or wrong API key: send Authorization: Bearer KEY", "invalid_api_key")

    @app.exception_handler(Forbidden)
    async def forbidden(request, exc):
        return json_error(403, str(exc), "forbidden")

    @app.exception_handler(RateLimited)
    async def rate_limited(request, exc):
        wait = max(1, int(exc.wait_s + 0.999))
        return json_error(
            429,
            f"this key's rate is used up; retry in {wait} s",
            "rate_limit_exceeded",
            headers={"Retry-After": str(wait)},
        )

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
        served = ", ".join(repr(name) for name in exc.allowed) or "none"
        return json_error(
            404, f"the model {exc.model[:200]!r} does not exist; this key may use: {served}", "model_not_found"
        )


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


def healthz_body(stores, **fields) -> dict:
    """What both fronts' /healthz answer: ok, the first store's generation, the served model id,
    and the front's own `fields` (which win)."""
    return {"status": "ok", "generation": stores.generation(), "model": SERVED_MODEL_ID, **fields}


def add_models_route(app: FastAPI, stores, access) -> None:
    """Both fronts' /v1/models: the caller's stores (ragkv.serve.stores.Stores.listing)."""

    @app.get("/v1/models")
    async def models(caller: Caller = Depends(access)):
        return stores.listing(caller)


def max_tokens(body: ChatRequest, settings: ServeSettings, warnings: list[str], key_cap: int | None = None) -> int:
    """The answer tokens a request may have: what it asks for (or the default), cut to the
    cap, and to its key's (`key_cap`) when lower (said in `warnings`)."""
    cap = min(settings.max_tokens_cap, key_cap or settings.max_tokens_cap)
    requested = body.max_completion_tokens or body.max_tokens or min(settings.default_max_tokens, cap)
    if requested > cap:
        warnings.append(f"max_tokens cut from {requested} to {cap}")
    return min(requested, cap)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """OpenAI's usage object; `prompt_tokens_details.cached_tokens`: the prompt tokens whose KV
    came from the store or an in-process cache (prefix, conversation) rather than a prefill."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion(
    reply_id: str, created: int, model_id: str, text: str, finish_reason: str, usage: dict | None, ragkv: dict
) -> dict:
    """A whole chat completion reply."""
    return {
        "id": reply_id,
        "object": "chat.completion",
        "created": created,
        "model": model_id,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}],
        "usage": usage,
        "ragkv": ragkv,
    }


def chunk_event(reply_id: str, created: int, model_id: str, delta: dict, finish: str | None = None, **extra) -> str:
    """One server-sent event in OpenAI's chat completion chunk format."""
    body = {
        "id": reply_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model_id,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        **extra,
    }
    return f"data: {json.dumps(body)}\n\n"


def error_event(message: str, kind: str) -> str:
    """The last event of a stream that failed after it began."""
    return f"data: {json.dumps({'error': {'message': message, 'type': kind}})}\n\n"
