"""The command line, end to end on the sample corpus with the bundled SmolLM2, and every
bad-input case: one line on stderr naming the problem, a non-zero exit, the store untouched."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.conftest import SAMPLE_DATA, run_cli


def run(*args):
    return run_cli(*args)


@pytest.mark.slow  # the bundled model over the whole sample corpus
def test_ingest_reports_what_it_did(sample_store):
    _, report = sample_store
    assert report["documents"] == {"added": 37, "changed": 0, "unchanged": 0, "removed": 0}
    assert report["skipped"] == [] and report["generation"] == 1
    assert report["kv_computed"] == report["chunks_embedded"] >= 37
    assert report["tokens_computed"] > 3000 and report["tokens_per_s"] > 0
    assert (report["model"], report["dtype"], report["device"]) == ("smollm2", "float32", "cpu")


@pytest.mark.slow  # the bundled model over the whole sample corpus
def test_ask_json_reuses_stored_kv_and_matches_a_full_prefill(sample_store):
    store, _ = sample_store
    question = "How do I rotate the API key?"
    cached = json.loads(run("ask", question, "--store", store, "--json", "--max-new-tokens", "32").stdout)
    full = json.loads(run("ask", question, "--store", store, "--json", "--max-new-tokens", "32", "--no-cache").stdout)
    assert set(cached) == {"question", "answer", "token_ids", "sources", "stats"}
    assert cached["sources"][0]["source"].endswith("runbooks/rotate-api-key.md")
    assert set(cached["sources"][0]) == {
        "doc_id",
        "source",
        "chunk_index",
        "chunk_id",
        "score",
        "section",
        "pages",
        "citation",
    }
    stats = cached["stats"]
    for key in ("reused_tokens", "computed_tokens", "ttft_s", "retrieval_ms", "kv_load_ms", "prefill_ms", "total_s"):
        assert key in stats
    assert stats["mode"] == "exact" and stats["reused_tokens"] > 100 and stats["computed_tokens"] < 40
    assert full["stats"]["mode"] == "full" and full["stats"]["reused_tokens"] == 0
    assert full["stats"]["computed_tokens"] == stats["reused_tokens"] + stats["computed_tokens"]
    assert cached["token_ids"] == full["token_ids"] and len(cached["token_ids"]) > 0
    assert cached["answer"] == full["answer"]


@pytest.mark.slow  # the bundled model over the whole sample corpus
def test_ask_prints_answer_source_and_stats(sample_store):
    store, _ = sample_store
    result = run("ask", "How many days of annual leave do I get?", "--store", store, "--max-new-tokens", "16")
    assert result.exit_code == 0
    assert result.stdout.strip()
    assert "source: " in result.stderr and "leave-policy.md" in result.stderr
    assert "tokens reused" in result.stderr and "TTFT" in result.stderr


@pytest.mark.slow  # the bundled model over the whole sample corpus
def test_re_ingesting_the_same_corpus_computes_nothing(sample_store, tmp_path):
    store, first = sample_store
    copy = tmp_path / "kvstore"
    shutil.copytree(store, copy)
    report = json.loads(run("ingest", SAMPLE_DATA, "--store", copy, "--json").stdout)
    assert report["documents"]["unchanged"] == first["documents"]["added"] > 30 and report["tokens_computed"] == 0
    assert report["tokens_skipped"] == first["tokens_computed"]


@pytest.mark.slow  # the bundled model over the whole sample corpus
def test_stats_describes_the_store(sample_store):
    store, report = sample_store
    stats = json.loads(run("stats", "--store", store, "--json").stdout)
    assert stats["documents"] == 37 and stats["chunks"] == stats["vectors"] == report["chunks_embedded"]
    (profile,) = stats["profiles"]
    assert (profile["model"], profile["dtype"]) == ("smollm2", "float32")
    assert profile["tokens"] == report["tokens_computed"] and profile["chunks"] == report["chunks_embedded"]
    bytes_per_token = 30 * 2 * 3 * 64 * 4  # layers x (k, v) x kv heads x head dim x float32
    assert profile["kv_bytes"] == stats["live_bytes"] and profile["kv_bytes"] % bytes_per_token == 0
    assert profile["kv_bytes"] // bytes_per_token > profile["tokens"]  # the chunks plus the system prefix
    assert stats["dead_bytes"] < 0.001 * stats["shard_bytes"]  # safetensors headers only


def one_line_error(result, exit_code, *fragments):
    assert result.exit_code == exit_code, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


@pytest.mark.slow  # the bundled model over the whole sample corpus
def test_bad_input_gets_one_line_and_leaves_the_store_untouched(sample_store, tmp_path):
    store, _ = sample_store
    before = {p: p.stat().st_mtime_ns for p in store.rglob("*")}
    one_line_error(run("ingest", tmp_path / "missing", "--store", store), 2, "does not exist")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "empty.md").write_text("")
    (bad / "blob.txt").write_bytes(b"\x00\xff")
    (bad / "latin1.txt").write_bytes(b"caf\xe9")
    one_line_error(run("ingest", bad, "--store", store), 2, "no documents to ingest", "empty")
    one_line_error(run("ingest", SAMPLE_DATA, "--store", store, "--model", tmp_path / "no-model"), 6, "does not exist")
    one_line_error(run("ingest", SAMPLE_DATA, "--store", store, "--chunk-tokens", 100000), 2, "does not fit", "at most")
    one_line_error(run("ingest", SAMPLE_DATA, "--store", store, "--dtype", "float8"), 2, "unknown --dtype")
    one_line_error(run("ask", "hi", "--store", store, "--top-k", 0), 2, "--top-k")
    one_line_error(run("ask", "hi", "--store", store, "--dtype", "bfloat16"), 6, "no KV for model")
    assert {p: p.stat().st_mtime_ns for p in store.rglob("*")} == before


def test_ask_on_a_missing_or_empty_store(tmp_path):
    one_line_error(run("ask", "hi", "--store", tmp_path / "nowhere"), 3, "no ragkv store", "ragkv ingest")
    from ragkv.store import StoreWriter

    with StoreWriter(tmp_path / "empty") as writer:
        writer.ensure_vectors(384)
    one_line_error(run("ask", "hi", "--store", tmp_path / "empty"), 3, "holds no documents")


def test_skipped_files_are_listed_in_the_summary(tiny_llama, corpus, tmp_path):
    docs = tmp_path / "docs"
    shutil.copytree(corpus, docs)
    (docs / "blob.txt").write_bytes(b"\x00\x01")
    result = run("ingest", docs, "--store", tmp_path / "s", "--model", tiny_llama)
    assert result.exit_code == 0
    assert "Skipped 1 file(s):" in result.stdout and "blob.txt: binary file" in result.stdout


@pytest.mark.parametrize(
    "command, expected",
    [
        ([], ["ingest", "ask", "stats", "reindex", "gc", "verify"]),
        (["reindex"], ["--report", "--no-gc", "--no-verify", "--json", "Exit code"]),
        (["verify"], ["--repair", "--json"]),
        (["ingest"], ["--chunk-tokens", "--model", "--dtype", "--json", "--store", "--system-prompt"]),
        (["ask"], ["--top-k", "--max-new-tokens", "--no-cache", "--json", "--store"]),
    ],
)
def test_help_teaches_the_options(command, expected):
    result = run(*command, "--help")
    assert result.exit_code == 0
    for word in expected:
        assert word in result.stdout
