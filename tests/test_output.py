"""ragkv.cli.output: what the commands print without --json says what their --json reports say."""

from __future__ import annotations

import json
import os

import pytest

from ragkv.cli.output import OutputFile, place
from ragkv.core.errors import InputError, OutputError
from tests.conftest import run_cli


def text_and_json(*args) -> tuple[str, dict]:
    printed, reported = run_cli(*args), run_cli(*args, "--json")
    assert printed.exit_code == 0 == reported.exit_code, printed.output + reported.output
    return printed.stdout, json.loads(reported.stdout.strip().splitlines()[-1])


def test_each_command_prints_its_report(tiny_llama, corpus, tmp_path):
    store = tmp_path / "store"
    printed = run_cli("ingest", corpus, "--store", store, "--model", tiny_llama, "--device", "cpu", "-q")
    assert printed.exit_code == 0, printed.output
    first, second = printed.stdout.splitlines()[:2]
    assert first.startswith(f"Store {store} (generation 1): ") and " 0 changed, 0 unchanged, 0 removed" in first
    assert second.startswith("KV: ") and "already stored" in second and "float32 on cpu" in second

    shown, stats = text_and_json("stats", "--store", store)
    assert f"{stats['documents']} documents, {stats['chunks']} chunks" in shown
    assert f"vector index: flat, {stats['index']['vectors']} vectors" in shown
    assert "lexical index: " in shown and "KV budget: none" in shown

    shown, budget = text_and_json("budget", "--store", store)
    assert budget["kv_budget"] is None and shown.strip().endswith("of no budget (all KV kept)")
    shown = run_cli("budget", "50MB", "--store", store).stdout
    assert shown.strip().endswith("of 50.0 MB budget")

    shown, verified = text_and_json("verify", "--store", store)
    assert verified["ok"] and shown.startswith(f"verify: generation {verified['generation']}, ")
    assert shown.splitlines()[0].endswith(": ok")

    shown = run_cli("gc", "--store", store).stdout
    assert shown.startswith("gc: 0 KV entries removed, ")


def test_a_citation_follows_the_path_it_names():
    assert place("manual.pdf p. 3, § Security", "manual.pdf") == " p. 3, § Security"
    assert place("notes.txt", "notes.txt") == ""


def test_an_output_file_is_checked_when_named_and_a_failed_write_is_named(tmp_path):
    with pytest.raises(InputError, match="is a folder"):
        OutputFile(tmp_path, "--out")
    with pytest.raises(InputError, match="does not exist"):
        OutputFile(tmp_path / "no" / "answers.jsonl", "--out")
    sink = OutputFile(tmp_path / "answers.jsonl", "--out")
    with sink:
        sink.write("one\n")
    assert (tmp_path / "answers.jsonl").read_text() == "one\n"
    (tmp_path / "answers.jsonl").chmod(0o400)
    if os.geteuid() != 0:  # root writes through file permissions
        with pytest.raises(OutputError, match="cannot write --out"):
            with OutputFile(tmp_path / "answers.jsonl", "--out"):
                pass


def test_stats_are_built_from_what_the_retrieval_and_the_loader_report():
    from dataclasses import fields

    from ragkv.engine.answer import Stats
    from ragkv.loading.loader import Loaded
    from ragkv.retrieval.retriever import Prompt

    # Every measure the loader and the retrieval report reaches the stats (a renamed field would
    # silently drop out of Stats.of).
    stat_names = {f.name for f in fields(Stats)}
    assert {f.name for f in fields(Loaded)} - stat_names == {"assembly", "fallback"}
    assert {f.name for f in fields(Prompt)} - stat_names == {"retrieved", "prompt_ids", "question_ids", "chunk_ids"}

    prompt = Prompt([], [1, 2], [2], [], retrieval_ms=3.0, num_reranked=4, warnings=["cut"])
    loaded = Loaded(None, kv_quant="int8", kv_sources={7: "ram"}, ram_hits=1, warnings=["slow"])
    stats = Stats.of("exact", prompt, loaded, ram_hits=5)
    assert (stats.mode, stats.retrieval_ms, stats.num_reranked, stats.kv_quant) == ("exact", 3.0, 4, "int8")
    assert stats.ram_hits == 5  # what is passed by name wins
    assert stats.warnings == ["cut", "slow"]
    stats.kv_sources[8] = "store"
    stats.warnings.append("more")
    assert loaded.kv_sources == {7: "ram"} and loaded.warnings == ["slow"]  # copies, not shared
