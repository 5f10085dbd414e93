"""`ragkv serve --engine vllm`: ragkv's retrieval and prompt layout in front of a vLLM server
that loads the store's KV through the ragkv connector (ragkv.integrations.vllm).

The front holds the store, the embedder and the tokenizer (no model weights); per request it
retrieves, lays out the prompt ids exactly as `ragkv serve` would, and sends them to vLLM's
`/v1/completions`. vLLM asks the connector which leading ids the store holds, loads their KV
into its blocks and prefills the rest. The API is the embedded service's: OpenAI chat
completions (streaming too) with a `ragkv` block naming the sources.

One question per request: earlier turns are refused (the store's KV covers a prompt's
system prefix and chunks; a conversation's history is vLLM's own prefix cache's job).
Every `ragkv` option is honoured or refused with a 400 naming it, never dropped: vLLM loads
the stored KV exactly, so only `mode: exact` runs; `no_cache` tells the connector to skip the
store (vLLM prefills the whole prompt); the repetition controls stay off, since vLLM's penalty also
counts the prompt's tokens and ragkv's counts only the answer's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import subprocess
import sys
import time
import uuid
from contextlib import asynccontextmanager

import httpx
from fastapi import Depends, FastAPI
from fastapi.responses import StreamingResponse

from ragkv.core.errors import InputError, ModelError
from ragkv.core.install import import_path
from ragkv.core.keys import digest
from ragkv.core.scope import cache_salt
from ragkv.kv.movable import refuse_unless_movable
from ragkv.serve.access import SERVED_MODEL_ID, Access
from ragkv.serve.api import (
    DONE_EVENT,
    ChatRequest,
    RagkvOptions,
    ServeSettings,
    add_models_route,
    chunk_event,
    completion,
    healthz_body,
    install_errors,
    run_server,
    split_messages,
    usage,
)
from ragkv.serve.api_keys import Caller
from ragkv.serve.audit import open_audit
from ragkv.serve.guard import RequestGuard
from ragkv.serve.stores import Stores, front_block, layout_params
from ragkv.store.kv.writeback import FoldLoop
from ragkv.store.objects import absolute

log = logging.getLogger("ragkv")
VLLM_MODEL_ID = "ragkv-llm"  # the name the front's vLLM serves the model under


class VllmServer:
    """A vLLM OpenAI server, started with the ragkv connector on `store`, in `python` (vLLM
    pins its own torch: it may live in another environment). `start` waits until it answers."""

    def __init__(
        self,
        python: str,
        model_folder: str,
        dtype: str,
        store: str,
        port: int,
        args: tuple[str, ...] = (),
        write_back: bool = True,
        connector_options: dict | None = None,
    ):
        self.model_folder = model_folder
        self.url = f"http://127.0.0.1:{port}"
        connector = {
            "kv_connector": "RagkvConnector",
            "kv_connector_module_path": "ragkv.integrations.vllm",
            "kv_role": "kv_both" if write_back else "kv_consumer",
            "kv_connector_extra_config": {"store": absolute(store), **(connector_options or {})},
        }
        self.command = [
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model_folder,
            "--served-model-name",
            VLLM_MODEL_ID,
            "--dtype",
            dtype,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--kv-transfer-config",
            json.dumps(connector),
            "--enable-prompt-tokens-details",  # usage.prompt_tokens_details.cached_tokens
            *args,
        ]
        root = import_path()  # so vLLM's python imports this ragkv
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float) -> None:
        refuse_unless_movable(self.model_folder)  # before vLLM starts: the connector moves attention KV of one shape
        self.process = subprocess.Popen(
            self.command,
            env=self.env,
            stdout=sys.stderr,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=_die_with_parent,
        )
        deadline = time.monotonic() + timeout_s  # a first start compiles kernels: minutes on a CPU
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = (self.process.stderr.read() if self.process.stderr else "")[-2000:].strip().splitlines()
                raise ModelError(
                    f"vLLM exited while starting ({self.process.returncode}): {tail[-1] if tail else 'no output'}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(1.0)
        self.stop()
        raise ModelError(f"vLLM did not answer within {timeout_s:.0f} s; see its log above")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()


def _die_with_parent() -> None:
    """In the vLLM child, before exec: SIGTERM it when this process dies, however it dies
    (uvicorn re-raises SIGTERM after its shutdown, so a `finally` in the front never runs)."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


def serve_on_vllm(engine, store: str, settings: ServeSettings, python: str, port: int, args: str, announce) -> None:
    """`ragkv serve --engine vllm`: starts vLLM (with the ragkv connector) on `port`, serves the
    front on uvicorn until interrupted, then stops vLLM. `engine` is opened without weights."""
    import shlex

    facts = engine.lm.facts
    options = {"pending_bytes": settings.pending_bytes, "leave_pending": settings.leave_pending}
    server = VllmServer(
        python, facts.path, facts.dtype, store, port, tuple(shlex.split(args)), settings.write_back, options
    )
    announce(f"starting vLLM ({python}) for {facts.name} on port {port}")
    server.start(timeout_s=1800)
    folding = FoldLoop(store, settings.fold_every_s).start() if settings.writer else None
    try:
        from ragkv.serve.service import reload_keys_on_sighup

        app = build_front_app(engine, server.url, settings)
        reload_keys_on_sighup(app.state.access)
        line = f"ragkv serving {store} ({facts.name}, engine vllm) on http://{settings.host}:{settings.port}"
        run_server(app, settings, announce, line)
    finally:
        server.stop()
        if folding is not None:
            folding.stop()


def build_front_app(engine, vllm_url: str, settings: ServeSettings, access: Access | None = None) -> FastAPI:
    """The OpenAI-compatible front: `engine` (a QueryEngine opened with weights=False) retrieves
    and lays out; vLLM at `vllm_url` generates. Each request runs in its caller's scope, and
    vLLM's prefix cache is salted by the caller's tenant (`cache_salt`)."""
    from ragkv.serve.service import access_for

    client = httpx.AsyncClient(base_url=vllm_url, timeout=None)
    lock = asyncio.Lock()  # the engine's retrieval is not thread-safe: one request lays out at a time
    access = access or access_for(settings)
    audit = open_audit(settings.audit_log, settings.audit_max_bytes)
    stores = Stores({SERVED_MODEL_ID: engine}, audit, settings)
    salts = TenantSalts()

    @asynccontextmanager
    async def lifespan(app):
        yield
        await client.aclose()
        audit.close()

    app = FastAPI(title="ragkv (vLLM)", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.access = access
    app.add_middleware(RequestGuard, max_body_bytes=settings.max_body_bytes)
    install_errors(app)

    @app.get("/healthz")
    async def healthz():
        vllm_ok = (await client.get("/health")).status_code == 200
        return healthz_body(stores, status="ok" if vllm_ok else "vllm down", engine="vllm")

    add_models_route(app, stores, access)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, caller: Caller = Depends(access)):
        handle = stores.open(body.model, caller)
        refuse_unsupported(body.ragkv)
        history, question, warnings = split_messages(body.messages)
        if history:
            raise InputError("--engine vllm answers one question per request; send only the last user message")
        ask = handle.ask_settings(body, warnings)
        async with lock:
            prompt = await asyncio.to_thread(handle.prompt_for, question, ask)
        payload = completion_payload(body, prompt, settings, ask.max_new_tokens, salts.of(caller))
        block = front_block(prompt, warnings)
        handle.record("/v1/chat/completions", [(s["doc_id"], s["chunk_id"]) for s in block["sources"]])
        created, reply_id = int(time.time()), f"chatcmpl-{uuid.uuid4().hex}"
        if not body.stream:
            return await _complete(client, payload, reply_id, created, block)
        return StreamingResponse(_relay(client, payload, reply_id, created, block), media_type="text/event-stream")

    return app


class TenantSalts:
    """vLLM's `cache_salt` for each tenant: a digest of the tenant's salt (`cache_salt`, the one
    every per-tenant cache of ragkv's keys by) and a secret drawn when the front starts. Secret
    here, unlike in ragkv's own caches: vLLM takes `cache_salt` from the request body, so a salt
    a client could compute (a tenant's name) would let it name another tenant's (vLLM's docs:
    the gateway sets it, never the client). None for callers without a tenant: they share
    vLLM's prefix cache."""

    def __init__(self):
        self._secret = secrets.token_hex(16)

    def of(self, caller: Caller) -> str | None:
        salt = cache_salt(caller.scope)
        return digest("ragkv-cache-salt", self._secret, salt)[:64] if salt else None


async def _complete(client: httpx.AsyncClient, payload: dict, reply_id: str, created: int, block: dict) -> dict:
    """A whole reply: vLLM's completion of the laid-out prompt, as a chat completion."""
    reply = await client.post("/v1/completions", json=payload)
    reply.raise_for_status()
    data = reply.json()
    choice = data["choices"][0]
    finish = choice.get("finish_reason") or "stop"
    return completion(reply_id, created, SERVED_MODEL_ID, choice["text"], finish, _usage(data.get("usage")), block)


def _usage(reported: dict | None) -> dict | None:
    """vLLM's usage as OpenAI clients read it: `cached_tokens` as vLLM counts them (its own
    prefix cache and the blocks the ragkv connector loaded from the store)."""
    if not reported:
        return reported
    details = reported.get("prompt_tokens_details") or {}
    return usage(reported["prompt_tokens"], reported["completion_tokens"], int(details.get("cached_tokens") or 0))


def completion_payload(
    body: ChatRequest, prompt, settings: ServeSettings, budget: int, salt: str | None = None
) -> dict:
    """The /v1/completions body sent to vLLM: the prompt's ids, the decoding asked, the layout
    the connector loads the stored KV by (or its opt-out, for `no_cache`) and the tenant's
    `cache_salt`, when it has one."""
    return {
        **({"cache_salt": salt} if salt else {}),
        "model": VLLM_MODEL_ID,
        "prompt": prompt.prompt_ids,
        "max_tokens": budget,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "seed": body.seed,
        "stop": body.stop,
        "stream": body.stream,
        "kv_transfer_params": {"ragkv": "skip"} if body.ragkv.no_cache else layout_params(prompt, settings),
        **({"stream_options": {"include_usage": True}} if body.stream else {}),
    }


def refuse_unsupported(options: RagkvOptions) -> None:
    """Raise InputError (a 400) naming the first `ragkv` option this front cannot honour."""
    if options.mode != "exact":
        raise InputError(
            f'ragkv.mode "{options.mode}" is not available with --engine vllm (vLLM loads the stored KV exactly); '
            'send "exact" or leave it out'
        )
    if "repetition_penalty" in options.model_fields_set and options.repetition_penalty != 1.0:
        raise InputError("ragkv.repetition_penalty is not available with --engine vllm; send 1.0 (off) or leave it out")
    if "no_repeat_ngram" in options.model_fields_set and options.no_repeat_ngram != 0:
        raise InputError("ragkv.no_repeat_ngram is not available with --engine vllm; send 0 (off) or leave it out")
    if options.reranker != "kv":
        raise InputError("ragkv.reranker is not available with --engine vllm (its rerank runs in ragkv); leave it out")
    if "rerank" in options.model_fields_set and options.rerank > 1:
        raise InputError(
            "ragkv.retrieval.rerank is not available with --engine vllm (the rerank runs ragkv's own model); "
            "send 0 (off) or leave it out"
        )


async def _relay(client: httpx.AsyncClient, payload: dict, reply_id: str, created: int, block: dict):
    """vLLM's completion events re-emitted as chat completion chunks; the last carries usage
    and the ragkv block."""

    def chunk(delta: dict, finish: str | None = None, **extra) -> str:
        return chunk_event(reply_id, created, SERVED_MODEL_ID, delta, finish, **extra)

    yield chunk({"role": "assistant", "content": ""})
    finish, reported = "stop", None
    async with client.stream("POST", "/v1/completions", json=payload) as reply:
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            reported = event.get("usage") or reported
            for choice in event.get("choices", []):
                if choice.get("text"):
                    yield chunk({"content": choice["text"]})
                finish = choice.get("finish_reason") or finish
    yield chunk({}, finish, usage=_usage(reported), ragkv=block)
    yield DONE_EVENT
