"""`ragkv batch`: every answer equals the single-question answer, and is counted like one."""

from __future__ import annotations

import json
import shutil

import pytest

import ragkv
from ragkv.core.config import AskSettings
from ragkv.engine.batch import Question, answer_all, read_questions
from tests.conftest import QUESTIONS, run_cli

BATCH = [
    "How do I rotate the API key?",
    "When should I rotate the API key?",
    "Who revokes the old API key?",
    "How many days of annual leave do I get?",
    "When are salaries paid?",
    "What is the guest wifi?",
]


@pytest.mark.parametrize("top_k, mode", [(1, "exact"), (2, "exact"), (2, "concat")])
def test_every_batched_answer_equals_asking_alone(tiny_store, top_k, mode):
    settings = AskSettings(top_k=top_k, max_new_tokens=10, mode=mode)
    with ragkv.open(tiny_store, device="cpu") as engine:
        outcomes = list(answer_all(engine, [Question(str(i), q) for i, q in enumerate(BATCH)], settings, max_batch=4))
        assert len(outcomes) == len(BATCH) and all(o.error is None for o in outcomes)
        for outcome in outcomes:
            alone = engine.ask(outcome.question.question, settings)
            assert outcome.answer.token_ids == alone.token_ids, outcome.question.question
            assert outcome.answer.prompt_ids == alone.prompt_ids
            assert [s.chunk_id for s in outcome.answer.sources] == [s.chunk_id for s in alone.sources]
            from_store = lambda stats: stats.reused_tokens - stats.prefix_cache_tokens  # noqa: E731
            assert from_store(outcome.answer.stats) == from_store(alone.stats)


@pytest.mark.slow  # the bundled model over the whole sample corpus
def test_the_bundled_model_batched_equals_alone(sample_store):
    settings = AskSettings(max_new_tokens=24)
    with ragkv.open(sample_store[0], device="cpu") as engine:
        outcomes = list(answer_all(engine, [Question(str(i), q) for i, q in enumerate(BATCH)], settings))
        for outcome in outcomes:
            assert outcome.answer.token_ids == engine.ask(outcome.question.question, settings).token_ids


def test_a_batch_decodes_together_and_counts_like_ask(tiny_store):
    settings = AskSettings(top_k=2, max_new_tokens=6)
    with ragkv.open(tiny_store, device="cpu") as engine:
        outcomes = list(answer_all(engine, [Question(str(i), q) for i, q in enumerate(BATCH)], settings, max_batch=4))
        assert max(o.answer.stats.batch_size for o in outcomes) > 1
        for outcome in outcomes:
            alone = engine.ask(outcome.question.question, settings).stats
            stats = outcome.answer.stats
            assert stats.prompt_tokens == alone.prompt_tokens
            # what the batch prefilled first, asking again finds in the prefix cache
            assert (
                stats.computed_tokens - alone.computed_tokens == alone.prefix_cache_tokens - stats.prefix_cache_tokens
            )
            assert stats.recomputed_tokens == alone.recomputed_tokens
            assert set(stats.kv_sources) == set(alone.kv_sources) and stats.kv_load_ms > 0


def test_batch_uses_reach_the_stores_popularity(tiny_store, tmp_path):
    store = tmp_path / "store"  # a copy: other tests' questions log their uses in the shared one
    shutil.copytree(tiny_store, store)
    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps({"id": str(i), "question": q}) for i, q in enumerate(BATCH)))
    before = json.loads(run_cli("stats", "--store", store, "--json").stdout)["uses"]
    result = run_cli(
        "batch",
        questions,
        "--out",
        tmp_path / "a.jsonl",
        "--store",
        store,
        "--top-k",
        "2",
        "--max-new-tokens",
        "2",
        "--json",
    )
    assert result.exit_code == 0, result.output
    after = json.loads(run_cli("stats", "--store", store, "--json").stdout)["uses"]
    assert after - before == 2 * len(BATCH)


def test_a_batch_question_over_the_context_fails_alone(tiny_llama, tmp_path):
    from tests.conftest import build_store

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("The valve manual says: turn left to open.")
    build_store(docs, tmp_path / "s", str(tiny_llama))
    long_question = "Why " + "really " * 1200 + "?"
    with ragkv.open(tmp_path / "s", device="cpu") as engine:
        outcomes = {
            o.question.id: o
            for o in answer_all(
                engine,
                [Question("long", long_question), Question("short", "How do I open the valve?")],
                AskSettings(max_new_tokens=2),
            )
        }
    assert "over the model's context" in outcomes["long"].error
    assert outcomes["short"].error is None and outcomes["short"].answer.token_ids


def test_the_batch_command_reports_bad_lines_and_answers_the_rest(tiny_store, tmp_path):
    questions = tmp_path / "q.jsonl"
    questions.write_text(
        "\n".join(
            [
                json.dumps({"id": "a", "question": QUESTIONS[0]}),
                "{not json",
                json.dumps({"id": "b", "question": "   "}),
                json.dumps({"id": "c", "question": "How long is leave?", "doc": "leave.txt"}),
                json.dumps({"id": "d", "question": "Anything?", "doc": "no-such-doc"}),
            ]
        )
    )
    result = run_cli(
        "batch", questions, "--out", tmp_path / "a.jsonl", "--store", tiny_store, "--max-new-tokens", "4", "--json"
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["answered"] == 2 and summary["questions"] == 5
    assert summary["savings"]["requests"] == 2 and 0 < summary["savings"]["saved_pct"] < 100
    lines = {json.loads(line).get("id"): json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()}
    assert lines["2"]["error"].startswith("line 2: not JSON")
    assert lines["3"]["error"] == 'line 3: no "question" text'
    assert lines["d"]["error"] == "no document 'no-such-doc' in the store"
    assert lines["c"]["sources"][0]["doc_id"] == "leave.txt" and lines["a"]["stats"]["reused_tokens"] > 0


def test_read_questions_names_each_bad_line(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text('{"question": "ok"}\n[1, 2]\n{"question": "x", "doc": 5}\n')
    questions, errors = read_questions(path)
    assert [q.id for q in questions] == ["1"]
    assert [e.error for e in errors] == ["line 2: not a JSON object", 'line 3: "doc" must be a document id string']
