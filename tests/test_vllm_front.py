"""`ragkv serve --engine vllm` honours every `ragkv` option or refuses it with a 400 naming it,
before anything reaches vLLM (no vLLM needed here: the refusals never leave the front)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

import ragkv
from ragkv.core.config import AskSettings
from ragkv.serve.api import ChatRequest, ServeSettings
from ragkv.serve.vllm_front import build_front_app, completion_payload, refuse_unsupported
from tests.conftest import QUESTIONS

UNREACHABLE = "http://127.0.0.1:9"  # nothing listens: a request that got this far would fail


@pytest.fixture()
def front(tiny_store):
    with ragkv.open(tiny_store, device="cpu", weights=False) as engine:
        yield engine, TestClient(build_front_app(engine, UNREACHABLE, ServeSettings()))


@pytest.mark.parametrize(
    "options, named",
    [
        ({"mode": "concat"}, "ragkv.mode"),
        ({"mode": "approximate"}, "ragkv.mode"),
        ({"repetition_penalty": 1.3}, "ragkv.repetition_penalty"),
        ({"no_repeat_ngram": 3}, "ragkv.no_repeat_ngram"),
        ({"rerank": 10}, "ragkv.retrieval.rerank"),
    ],
)
def test_an_option_vllm_cannot_honour_is_a_400_naming_it(front, options, named):
    _, client = front
    body = {"messages": [{"role": "user", "content": QUESTIONS[0]}], "ragkv": options}
    reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 400
    message = reply.json()["error"]["message"]
    assert named in message and "--engine vllm" in message and "\n" not in message


def test_options_it_can_honour_pass_and_no_cache_skips_the_store(front):
    engine, _ = front
    for options in ({}, {"mode": "exact"}, {"repetition_penalty": 1.0, "no_repeat_ngram": 0}, {"no_cache": True}):
        refuse_unsupported(
            ChatRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "ragkv": options}).ragkv
        )
    prompt = engine.prompt_for(QUESTIONS[0], AskSettings(top_k=1, context="chunk"))

    def payload(options: dict) -> dict:
        body = ChatRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "ragkv": options})
        return completion_payload(body, prompt, ServeSettings(), 8)

    laid_out = payload({})["kv_transfer_params"]["ragkv"]
    assert laid_out["chunks"] == [
        [row.chunk_id, len(ids)] for (row, _), ids in zip(prompt.retrieved, prompt.chunk_ids, strict=True)
    ]
    assert payload({"no_cache": True})["kv_transfer_params"] == {"ragkv": "skip"}  # the connector's opt-out
    assert payload({"no_cache": True})["prompt"] == prompt.prompt_ids  # the same prompt, prefilled by vLLM


def test_vllm_is_started_on_the_store_as_named_with_the_replica_s_pending_options(tmp_path, monkeypatch):
    """An S3 store reaches the connector as its URI (a folder as an absolute path), with the
    options that make the replica leave its KV pending within its bound."""
    import json

    from ragkv.serve.vllm_front import VllmServer

    def connector_config(store: str) -> dict:
        server = VllmServer("python", "model", "float32", store, 8100, (), True, {"pending_bytes": 5 << 20})
        return json.loads(server.command[server.command.index("--kv-transfer-config") + 1])

    config = connector_config("s3://bucket/kv")
    assert config["kv_connector_extra_config"] == {"store": "s3://bucket/kv", "pending_bytes": 5 << 20}
    assert config["kv_role"] == "kv_both"
    monkeypatch.chdir(tmp_path)
    assert connector_config("kv")["kv_connector_extra_config"]["store"] == str(tmp_path.resolve() / "kv")


def test_the_front_salts_vllms_prefix_cache_per_tenant_and_scopes_retrieval(tiny_store, tmp_path):
    from ragkv.serve.api_keys import Caller, key_digest
    from ragkv.serve.vllm_front import TenantSalts

    salts, other = TenantSalts(), TenantSalts()
    a, b = Caller(ragkv.Scope("a")), Caller(ragkv.Scope("b"))
    assert salts.of(a) == salts.of(a) != salts.of(b) and salts.of(Caller()) is None
    assert salts.of(a) != other.of(a)  # a secret drawn per front: no client can compute it
    assert len(salts.of(a)) <= 128 and not set("@/\\\0") & set(salts.of(a))  # what vLLM accepts
    keys = tmp_path / "keys.toml"
    keys.write_text(f'[[keys]]\ntenant = "b"\nsha256 = "{key_digest("kb").hex()}"\nfilters = ["path=nowhere/*"]\n')
    with ragkv.open(tiny_store, device="cpu", weights=False) as engine:
        client = TestClient(build_front_app(engine, UNREACHABLE, ServeSettings(keys_file=str(keys))))
        body = {"messages": [{"role": "user", "content": QUESTIONS[0]}]}
        assert client.post("/v1/chat/completions", json=body).status_code == 401
        # Its scope admits nothing: refused before vLLM (unreachable here) is asked.
        reply = client.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer kb"})
        assert reply.status_code == 404 and "returned no chunks" in reply.json()["error"]["message"]
        assert [m["id"] for m in client.get("/v1/models", headers={"Authorization": "Bearer kb"}).json()["data"]] == [
            "ragkv"
        ]
        prompt = engine.prompt_for(QUESTIONS[0], AskSettings(top_k=1, context="chunk"))
        request = ChatRequest.model_validate(body)
        assert completion_payload(request, prompt, ServeSettings(), 8, salts.of(a))["cache_salt"] == salts.of(a)
        assert "cache_salt" not in completion_payload(request, prompt, ServeSettings(), 8, None)
