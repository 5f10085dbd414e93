"""The cross-encoder rerank (ragkv.retrieval.cross_encoder), on a tiny random CrossEncoder built
from a config, as the tests build tiny LLMs; and the latency each stage reports."""

from __future__ import annotations

import json

import pytest

import ragkv
from ragkv.core.config import DEFAULT_EMBEDDER
from ragkv.core.errors import InputError
from ragkv.model.embed import resolve_embedder_path
from ragkv.retrieval.cross_encoder import CrossEncoders
from tests.conftest import QUESTIONS, run_cli


@pytest.fixture(scope="session")
def tiny_cross_encoder(tmp_path_factory) -> str:
    """A 2-layer BERT sequence classifier (one logit) with random weights and MiniLM's vocabulary."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(resolve_embedder_path(DEFAULT_EMBEDDER))
    config = BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=1,
    )
    folder = tmp_path_factory.mktemp("cross") / "tiny-cross-encoder"
    BertForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def test_the_cross_encoder_orders_the_candidates_by_its_own_scores(tiny_store, tiny_cross_encoder):
    from sentence_transformers import CrossEncoder

    reference = CrossEncoder(tiny_cross_encoder, device="cpu")
    question = QUESTIONS[0]
    with ragkv.open(tiny_store) as engine:
        first = engine.search(question, 4)
        scores = reference.predict([(question, r.text) for r in first], show_progress_bar=False)
        expected = [r.chunk_id for _, r in sorted(zip(scores.tolist(), first, strict=True), key=lambda p: -p[0])]
        crossed = engine.search(question, 4, rerank=4, reranker=tiny_cross_encoder)
        assert [r.chunk_id for r in crossed] == expected
        assert crossed.latency_ms["cross_encoder_ms"] > 0 and "rerank_ms" not in crossed.latency_ms
        both = engine.search(question, 1, rerank=4, reranker=f"kv+{tiny_cross_encoder}")
        kv_best = engine.search(question, 2, rerank=4)  # the cross-encoder reads the kv rerank's best 2 x top_k
        assert both[0].chunk_id in {r.chunk_id for r in kv_best}
        assert {"rerank_ms", "cross_encoder_ms"} <= set(both.latency_ms)
        answer = engine.ask(question, top_k=1, rerank=4, reranker=tiny_cross_encoder, max_new_tokens=2)
        assert answer.sources[0].chunk_id == expected[0] and answer.stats.rerank_ms > 0
        with ragkv.open(tiny_store) as other:
            other.search(question, 2, rerank=3, reranker=tiny_cross_encoder)
    assert len([k for k in CrossEncoders._loaded if k[0] == tiny_cross_encoder]) == 1  # loaded once per process
    with pytest.raises(InputError, match="kv\\+MODEL"):
        ragkv.AskSettings(reranker="kv+")


def test_search_json_reports_each_stages_latency(tiny_store, tiny_cross_encoder):
    said = run_cli(
        "search", QUESTIONS[0], "--store", tiny_store, "--json", "--rerank", "3", "--reranker", tiny_cross_encoder
    )
    found = json.loads(said.output)
    assert {"embed_ms", "dense_ms", "lexical_ms", "fuse_ms", "catalog_ms", "cross_encoder_ms"} <= set(
        found["latency_ms"]
    )
    asked = json.loads(run_cli("ask", QUESTIONS[0], "--store", tiny_store, "--json", "--max-new-tokens", "2").output)
    assert asked["stats"]["embed_ms"] > 0 and asked["stats"]["retrieval_ms"] >= asked["stats"]["embed_ms"]


def test_a_server_loads_only_the_cross_encoders_it_was_started_with(tiny_store, tiny_cross_encoder):
    from fastapi.testclient import TestClient

    from ragkv.serve.api import ServeSettings
    from ragkv.serve.service import build_app

    with ragkv.open(tiny_store) as engine:
        app = build_app(engine, ServeSettings(rerankers=(tiny_cross_encoder,)))
        with TestClient(app) as client:
            body = {"query": QUESTIONS[0], "top_k": 2, "rerank": 3}
            offered = client.post("/v1/retrieve", json={**body, "reranker": tiny_cross_encoder})
            assert offered.status_code == 200 and "cross_encoder_ms" in offered.json()["latency_ms"]
            other = client.post("/v1/retrieve", json={**body, "reranker": "/etc"})
            assert other.status_code == 400 and "not offered" in other.json()["error"]["message"]
            chat = {"messages": [{"role": "user", "content": QUESTIONS[0]}], "max_tokens": 2}
            reply = client.post(
                "/v1/chat/completions", json={**chat, "ragkv": {"rerank": 3, "reranker": tiny_cross_encoder}}
            )
            assert reply.status_code == 200 and reply.json()["ragkv"]["stats"]["rerank_ms"] > 0
