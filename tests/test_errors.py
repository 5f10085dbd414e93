"""Bad input gets one line on stderr and a documented exit code, never a traceback; options
are checked before anything is loaded; a no-op writer publishes nothing."""

from __future__ import annotations

import json
import re
import shutil

import pytest

import ragkv.engine.active
from ragkv.store import StoreWriter, collect_garbage
from ragkv.store.generations import read_current

from .conftest import QUESTIONS, ROOT, run_cli

DOCUMENTED_EXIT_CODES = {0, 2, 3, 4, 5, 6, 7}  # docs/cli.md lists them; 1 is only ever a bug or Ctrl-C
READERS = {
    "ask": ["ask", "hi"],
    "stats": ["stats"],
    "verify": ["verify"],
    "chat": ["chat"],
    "serve": ["serve"],
    "batch": ["batch", "{questions}", "--out", "{out}"],
}
WRITERS = {"ingest": ["ingest", "{docs}"], "reindex": ["reindex", "{docs}"], "gc": ["gc"]}


@pytest.fixture()
def bad_stores(tmp_path):
    (tmp_path / "file").write_text("not a store")
    (tmp_path / "empty").mkdir()
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("somebody's files")
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "CURRENT").write_text("banana")
    (tmp_path / "questions.jsonl").write_text('{"question": "hi"}\n')
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("Salaries are paid on the 25th.")
    return tmp_path


def _args(template, root):
    return [a.format(questions=root / "questions.jsonl", out=root / "out.jsonl", docs=root / "docs") for a in template]


def _assert_one_line_error(result, expected_code):
    assert result.exit_code == expected_code, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.output, result.stderr


@pytest.mark.parametrize("kind, code", [("file", 3), ("missing", 3), ("empty", 3), ("foreign", 3), ("garbage", 4)])
@pytest.mark.parametrize("command", sorted(READERS))
def test_every_reader_names_a_bad_store_in_one_line(bad_stores, command, kind, code):
    result = run_cli(*_args(READERS[command], bad_stores), "--store", bad_stores / kind)
    _assert_one_line_error(result, code)
    assert not (bad_stores / "missing").exists()  # reading never creates a store


@pytest.mark.parametrize("kind, code", [("file", 2), ("foreign", 2), ("garbage", 4), ("missing", 3)])
@pytest.mark.parametrize("command", sorted(WRITERS))
def test_every_writer_refuses_a_bad_store_in_one_line_and_leaves_it_alone(bad_stores, command, kind, code):
    if kind == "missing" and command != "gc":
        pytest.skip("ingest and reindex create a missing store")
    before = sorted(p.name for p in bad_stores.rglob("*"))
    result = run_cli(*_args(WRITERS[command], bad_stores), "--store", bad_stores / kind)
    _assert_one_line_error(result, code)
    assert sorted(p.name for p in bad_stores.rglob("*")) == before


@pytest.mark.parametrize(
    "option",
    [
        ["--top-k", "0"],
        ["--max-new-tokens", "-1"],
        ["--mode", "fastest"],
        ["--temperature", "-1"],
        ["--top-p", "0"],
        ["--repetition-penalty", "0.5"],
        ["--no-repeat-ngram", "-2"],
        ["--device", "tpu"],
        ["--dtype", "float8"],
        ["--kv-dtype", "int3"],
    ],
)
def test_ask_checks_its_options_before_loading_a_model(tiny_store, monkeypatch, option):
    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the options were checked")

    monkeypatch.setattr(ragkv.engine.active, "load_model", no_loading)
    result = run_cli("ask", QUESTIONS[0], "--store", tiny_store, *option)
    _assert_one_line_error(result, 2)
    assert option[0] in result.stderr


def test_chat_and_batch_check_their_options_before_opening_the_store(tmp_path):
    (tmp_path / "q.jsonl").write_text('{"question": "hi"}\n')
    missing = tmp_path / "no-store"  # checked first: the error names the option, not the store
    _assert_one_line_error(run_cli("chat", "--store", missing, "--top-k", "0"), 2)
    _assert_one_line_error(
        run_cli("batch", tmp_path / "q.jsonl", "--out", tmp_path / "a.jsonl", "--store", missing, "--max-batch", "0"), 2
    )


def test_every_exit_code_the_cli_returns_is_documented(tiny_store, corpus, tmp_path):
    section = (ROOT / "docs" / "cli.md").read_text().split("## Exit codes")[1].split("\n## ")[0]
    listed = {int(code) for code in re.findall(r"^\| `(\d)` \|", section, flags=re.M)}
    assert listed == DOCUMENTED_EXIT_CODES | {1}
    assert run_cli("stats", "--store", tiny_store).exit_code == 0
    assert run_cli("ask", "?", "--store", tiny_store, "--top-k", "0").exit_code == 2
    assert run_cli("ask", "?", "--store", tmp_path / "none").exit_code == 3
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "CURRENT").write_text("x")
    assert run_cli("stats", "--store", tmp_path / "bad").exit_code == 4
    writer = StoreWriter(tiny_store)
    try:
        assert run_cli("gc", "--store", tiny_store).exit_code == 5
    finally:
        writer.abort()
    assert run_cli("ingest", corpus, "--store", tmp_path / "s", "--model", tmp_path / "no-model").exit_code == 6


def test_a_gc_or_reindex_that_changes_nothing_publishes_nothing(tiny_llama, corpus, tmp_path):
    store = tmp_path / "store"
    args = ["--store", store, "--model", tiny_llama, "--device", "cpu", "--json", "--quiet"]
    assert run_cli("ingest", corpus, *args).exit_code == 0
    assert read_current(store) == 1
    again = json.loads(run_cli("ingest", corpus, *args).stdout)
    assert again["generation"] == 1 and again["tokens_computed"] == 0
    assert collect_garbage(store).generation == 1
    reindex = run_cli("reindex", corpus, *args)
    assert reindex.exit_code == 0 and json.loads(reindex.stdout)["ingest"]["generation"] == 1
    assert read_current(store) == 1 and sorted(p.name for p in store.glob("catalog-*")) == ["catalog-000001.duckdb"]
    # A real change still publishes.
    docs = tmp_path / "docs"
    shutil.copytree(corpus, docs)
    (docs / "new.md").write_text("Parking is free for employees on level -2.")
    assert json.loads(run_cli("ingest", docs, *args).stdout)["generation"] == 2


def test_the_library_is_quiet_unless_asked(tiny_store, capfd):
    import ragkv

    with ragkv.open(tiny_store, device="cpu") as engine:
        engine.ask(QUESTIONS[0], max_new_tokens=2)
    out, err = capfd.readouterr()
    assert out == "" and err == ""  # no "Loading weights" bars, no warnings
