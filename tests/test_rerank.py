"""The rerank that reads the stored KV (ragkv.retrieval.rerank): each candidate's score equals the one a
full prefill of the same ids gives, whether the KV comes from the store, a span's run, or the
candidate's text; `ask --rerank` answers from the reranked chunks exactly; `search` is one
function for the CLI, the API and the service."""

from __future__ import annotations

import json

import pytest
import torch

import ragkv
from ragkv.core.config import AskSettings
from ragkv.kv import cache as kv
from ragkv.model.prompt import encode_text
from ragkv.retrieval.rerank import question_likelihoods
from tests.conftest import QUESTIONS, build_store, run_cli
from tests.test_spans import SPAN_TOKENS, write_doc

PLAIN = {"repetition_penalty": 1.0, "no_repeat_ngram": 0}


def _full_prefill_likelihood(engine, row_ids: list[int], question: str) -> float:
    """Mean log P(question token | prefix + context + question head), from one full forward."""
    layout = engine.active.layout
    tokenizer = engine.lm.tokenizer
    question_ids = encode_text(tokenizer, question)
    ids = [*layout.prefix_ids, *row_ids, *layout.question_head_ids, *question_ids]
    with torch.inference_mode():
        logits = engine.lm.model(input_ids=torch.tensor([ids])).logits[0].float()  # (T, V)
    log_probs = logits[-len(question_ids) - 1 : -1].log_softmax(-1)  # the positions that predict the question
    return float(log_probs.gather(-1, torch.tensor(question_ids)[:, None]).mean())


def _context_ids(engine, doc_id: str, chunk_index: int, span: bool) -> list[int]:
    """The ids a candidate is scored over: its chunk, or its span's chunks up to it."""
    rows = [r for r, _ in engine.retrieve("anything", top_k=100, context="chunk")]
    rows = sorted((r for r in rows if r.doc_id == doc_id), key=lambda r: r.chunk_index)
    wanted = [r for r in rows if r.chunk_index == chunk_index]
    if span and wanted[0].span_start is not None:
        wanted = [r for r in rows if wanted[0].span_start <= r.chunk_index <= chunk_index]
    return engine.active.layout.context_ids([engine.chunk_token_ids(r) for r in wanted])


def test_a_candidate_scores_what_a_full_prefill_of_its_prompt_scores(tiny_store):
    with ragkv.open(tiny_store) as engine:
        found = engine.search(QUESTIONS[0], top_k=5, rerank=5)
        assert len(found) == 5 and all(r.likelihood is not None for r in found)
        assert [r.score for r in found] == sorted((r.score for r in found), reverse=True)
        for result in found:
            ids = _context_ids(engine, result.doc_id, result.chunk_index, span=False)
            assert abs(result.likelihood - _full_prefill_likelihood(engine, ids, QUESTIONS[0])) < 1e-4


def test_a_batch_of_different_lengths_scores_each_row_as_alone(tiny_llama):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    contexts = []
    for length in (3, 17, 9):  # real KV of random ids, computed alone
        ids = torch.randint(5, model.config.vocab_size, (1, length))
        with torch.inference_mode():
            cache = model(input_ids=ids, use_cache=True).past_key_values
        contexts.append([kv.from_cache(cache)])  # (L, 2, H, T, D)
    question = [7, 8, 9, 10, 11]
    together = question_likelihoods(model, contexts, question, 3)
    alone = [question_likelihoods(model, [c], question, 3)[0] for c in contexts]
    assert together == pytest.approx(alone, abs=1e-5)
    assert len(set(together)) == 3  # the contexts differ, so must their scores


def test_ask_with_rerank_answers_from_the_reranked_chunks_exactly(tiny_store):
    with ragkv.open(tiny_store) as engine:
        found = engine.search(QUESTIONS[1], top_k=2, rerank=6)
        settings = {"top_k": 2, "rerank": 6, "context": "chunk", "max_new_tokens": 12, **PLAIN}
        cached = engine.ask(QUESTIONS[1], **settings)
        full = engine.ask(QUESTIONS[1], **settings, use_cache=False)
        assert [s.chunk_id for s in cached.sources] == [r.chunk_id for r in found]
        assert cached.prompt_ids == full.prompt_ids and cached.token_ids == full.token_ids
        assert cached.stats.num_reranked == 6 and cached.stats.rerank_ms > 0
        plain = engine.ask(QUESTIONS[1], **{**settings, "rerank": 0})
        assert plain.stats.num_reranked == 0 and plain.stats.rerank_ms == 0


def test_a_span_candidate_is_scored_over_its_run_from_the_span_start(tiny_llama, tmp_path):
    store = tmp_path / "store"
    build_store(write_doc(tmp_path / "docs"), store, str(tiny_llama), chunk_tokens=24, span_tokens=SPAN_TOKENS)
    question = "Who leads the incident review?"
    with ragkv.open(store) as engine:
        found = engine.search(question, top_k=8, rerank=8)
        inside = [r for r in found if r.doc_id == "incidents.md" and r.chunk_index > 0]
        assert inside
        for result in inside:
            ids = _context_ids(engine, result.doc_id, result.chunk_index, span=True)
            assert abs(result.likelihood - _full_prefill_likelihood(engine, ids, question)) < 1e-4


def test_candidates_without_stored_kv_are_scored_from_their_text(tiny_llama, corpus, tmp_path):
    store = tmp_path / "lazy"
    build_store(corpus, store, str(tiny_llama), precompute=0)
    with ragkv.open(store, write_back=False) as engine:
        found = engine.search(QUESTIONS[2], top_k=3, rerank=4)
        for result in found:
            ids = _context_ids(engine, result.doc_id, result.chunk_index, span=False)
            assert abs(result.likelihood - _full_prefill_likelihood(engine, ids, QUESTIONS[2])) < 1e-4
        answer = engine.ask(QUESTIONS[2], top_k=1, rerank=4, max_new_tokens=4)
        assert answer.sources[0].chunk_id == found[0].chunk_id


def test_rerank_larger_than_the_store_is_cut_to_what_exists(tiny_store):
    with ragkv.open(tiny_store) as engine:
        every = engine.search(QUESTIONS[0], top_k=100)
        found = engine.search(QUESTIONS[0], top_k=100, rerank=100)
        assert sorted(r.chunk_id for r in found) == sorted(r.chunk_id for r in every)
        assert engine.ask(QUESTIONS[0], top_k=1, rerank=100, max_new_tokens=2).stats.num_reranked == len(every)


def test_search_cli_prints_json_and_answers_a_file_of_questions(tiny_store, tmp_path):
    result = run_cli("search", QUESTIONS[0], "--store", str(tiny_store), "--top-k", "2", "--rerank", "4", "--json")
    assert result.exit_code == 0, result.output
    found = json.loads(result.output)
    assert found["question"] == QUESTIONS[0] and len(found["results"]) == 2
    assert {"doc_id", "chunk_index", "chunk_id", "score", "text", "retrieval_score", "likelihood"} <= set(
        found["results"][0]
    )
    questions = tmp_path / "q.jsonl"
    lines = ['{"id": "a", "question": "When are salaries paid?"}', "not json", '{"id": "b", "question": "Wifi?"}']
    questions.write_text("\n".join(lines) + "\n")
    result = run_cli("search", "--file", str(questions), "--store", str(tiny_store), "--top-k", "3")
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.output.splitlines()]
    assert [line.get("id") for line in lines] == ["2", "a", "b"]
    assert "error" in lines[0] and len(lines[1]["results"]) == 3 and lines[2]["results"]
    text = run_cli("search", QUESTIONS[1], "--store", str(tiny_store), "--top-k", "1")
    assert text.exit_code == 0 and text.output.startswith("1. ")


@pytest.mark.parametrize(
    "args",
    [("--rerank", "-1"), ("--rerank", "101"), ("--top-k", "0")],
)
def test_search_refuses_bad_bounds_in_one_line_before_any_model_loads(args, tmp_path):
    result = run_cli("search", "question", "--store", str(tmp_path / "nowhere"), *args)
    assert result.exit_code == 2
    assert len(result.output.strip().splitlines()) == 1


def test_search_needs_a_question_or_a_file(tmp_path):
    result = run_cli("search", "--store", str(tmp_path / "nowhere"))
    assert result.exit_code == 2 and "--file" in result.output


def test_settings_bound_rerank():
    with pytest.raises(ragkv.InputError, match="--rerank"):
        AskSettings(rerank=-1)


def test_the_service_retrieves_with_the_same_search(tiny_store):
    from fastapi.testclient import TestClient

    from ragkv.serve.api import ServeSettings
    from ragkv.serve.service import build_app

    with ragkv.open(tiny_store) as engine:
        with TestClient(build_app(engine, ServeSettings())) as client:
            body = {"query": QUESTIONS[2], "top_k": 2, "rerank": 5}
            reply = client.post("/v1/retrieve", json=body)
        assert reply.status_code == 200, reply.text
        found = reply.json()["data"]
        assert found == [r.to_dict() for r in engine.search(QUESTIONS[2], top_k=2, rerank=5)]
        assert all(r["likelihood"] is not None for r in found)  # the model scored them


def test_the_attention_score_of_one_candidate_is_the_attention_a_full_prefill_pays_it(tiny_llama):
    """ICR's mass (ragkv.retrieval.rerank.attention_mass, the probe over stored KV) against the attention
    weights of a plain forward of the whole prompt (eager attention), each question token's
    weights over the context taken as a distribution (the probe's softmax is over the context):
    with one candidate the cache is the exact one, so the two must agree."""
    from transformers import AutoModelForCausalLM

    from ragkv.retrieval.rerank import attention_mass

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32, attn_implementation="eager").eval()
    prefix, chunk, question = [5, 6, 7, 8], list(range(20, 45)), [9, 10, 11, 12, 13]
    with torch.inference_mode():
        cache = model(input_ids=torch.tensor([prefix + chunk]), use_cache=True).past_key_values
        attentions = model(input_ids=torch.tensor([prefix + chunk + question]), output_attentions=True).attentions
    stored = kv.from_cache(cache)  # P + T tokens
    prefix_kv, chunk_kv = stored.tokens(0, len(prefix)), stored.tokens(len(prefix), stored.num_tokens)
    context = len(prefix) + len(chunk)
    over_context = [a[0, :, -len(question) :, :context] for a in attentions]  # (H, Q, C) per layer
    expected = sum(float((w / w.sum(-1, keepdim=True))[..., len(prefix) :].sum()) for w in over_context)
    model.config._attn_implementation = "sdpa"  # as ragkv runs it: the probe sits beside sdpa
    (found,) = attention_mass(model, prefix_kv, [chunk_kv], question, [])
    assert found == pytest.approx(expected / len(question), rel=1e-4)
    (calibrated,) = attention_mass(model, prefix_kv, [chunk_kv], question, [9])
    (alone,) = attention_mass(model, prefix_kv, [chunk_kv], [9], [])
    assert calibrated == pytest.approx(found - alone, rel=1e-4)  # less what a content-free question pays it
