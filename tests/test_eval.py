"""`ragkv eval` (ragkv.retrieval.evaluate): the metrics on known rankings, the bootstrap, the
input's errors, and the command over a real store with several settings side by side."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

from ragkv.core.errors import InputError
from ragkv.retrieval.evaluate import Item, Setting, bootstrap, normalise, read_items, score, token_f1
from tests.conftest import run_cli


def result(doc_id: str, chunk_id: int = 0, text: str = ""):
    return SimpleNamespace(doc_id=doc_id, chunk_id=chunk_id, text=text)


def test_the_metrics_of_known_rankings():
    one = Item(1, "q", doc_ids=frozenset({"b"}))
    ranked = [result("a"), result("b"), result("b"), result("c")]
    found = score(one, ranked)
    assert found["recall@1"] == 0 and found["recall@5"] == 1 and found["mrr@10"] == 0.5
    assert found["ndcg@10"] == pytest.approx(1 / math.log2(3))  # the second copy of b gains nothing
    two = Item(1, "q", chunk_ids=frozenset({7}), spans=("rotate  the KEY",))
    found = score(two, [result("x", 7), result("y", 8, "First, Rotate the key monthly.")])
    assert found["recall@1"] == 0.5 and found["recall@5"] == 1.0 and found["ndcg@10"] == pytest.approx(1.0)
    assert score(one, [])["mrr@10"] == 0 and score(one, [])["recall@10"] == 0


def test_the_bootstrap_and_the_answer_scores():
    assert bootstrap([0.5] * 20) == {"mean": 0.5, "low": 0.5, "high": 0.5}
    spread = bootstrap([0.0, 1.0] * 50)
    assert spread["low"] < 0.5 < spread["high"] and spread["mean"] == 0.5
    assert normalise("The API key, rotated!") == "api key rotated"
    assert token_f1("rotate the key monthly", "Rotate the key") == pytest.approx(0.8)
    assert token_f1("", "") == 1.0 and token_f1("x", "y") == 0.0


def test_questions_and_settings_that_do_not_read_are_one_line_errors(tmp_path):
    path = tmp_path / "q.jsonl"
    for text, said in (
        ("not json", "line 1 is not JSON"),
        ('{"question": "q"}', "names nothing"),
        ('{"doc_ids": ["a"]}', 'no "question"'),
        ('{"question": "q", "chunk_ids": ["x"]}', "chunk_ids"),
        ("", "no questions"),
    ):
        path.write_text(text)
        with pytest.raises(InputError, match=said) as error:
            read_items(path)
        assert "\n" not in str(error.value)
    assert Setting.parse("hybrid --rerank 10") == Setting("hybrid --rerank 10", "hybrid", 10)
    assert Setting.parse("--reranker kv+m").reranker == "kv+m"
    for bad in ("sparse", "dense --rerank x", "dense --top-k 3"):
        with pytest.raises(InputError):
            Setting.parse(bad)


def test_eval_compares_settings_side_by_side_on_a_store(tiny_store, tmp_path):
    from ragkv.store import open_snapshot

    with open_snapshot(tiny_store) as snapshot:
        ids = sorted(snapshot.catalog.documents.chunk_ids())
        texts = snapshot.catalog.documents.chunk_texts(ids)
        docs = snapshot.catalog.con.execute("SELECT chunk_id, doc_id FROM chunks").fetchall()
    doc_of = dict(docs)
    lines = [
        {"question": " ".join(texts[i].split()[:12]), "doc_ids": [doc_of[i]], "answer": " ".join(texts[i].split()[:3])}
        for i in ids
        if len(texts[i].split()) > 12
    ]
    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps(line) + "\n" for line in lines))
    plot = tmp_path / "eval.png"
    said = run_cli(
        "eval",
        questions,
        "dense",
        "lexical",
        "--store",
        tiny_store,
        "--json",
        "--plot",
        plot,
        "--answers",
        "--max-new-tokens",
        "2",
    )
    report = json.loads(said.output)
    assert [s["setting"] for s in report["settings"]] == ["dense", "lexical"] and report["questions"] == len(lines)
    for setting in report["settings"]:
        for name in ("recall@1", "recall@5", "recall@10", "mrr@10", "ndcg@10", "exact_match", "f1"):
            m = setting["metrics"][name]
            assert 0 <= m["low"] <= m["mean"] <= m["high"] <= 1
        assert setting["answered"] == len(lines) and setting["errors"] == 0
        assert {"embed", "total"} <= set(setting["latency_ms"]) or {"lexical", "total"} <= set(setting["latency_ms"])
    lexical = report["settings"][1]["metrics"]
    assert lexical["recall@10"]["mean"] > 0.5  # the questions are the chunks' own words
    assert plot.stat().st_size > 0
    table = run_cli("eval", questions, "--store", tiny_store).output
    assert "recall@1" in table and "latency ms" in table and "hybrid" in table
