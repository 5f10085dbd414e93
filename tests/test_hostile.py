"""The hostile battery's CLI and store rows: each gets one `error:` line (or a listed skip) and
its documented exit code, never a traceback, and the store is unharmed (it still verifies and
answers as before). Real files, a tiny real model, the real CLI (in process)."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest

import ragkv
from ragkv.pipelines.reading.read import read_documents
from tests.conftest import QUESTIONS


@pytest.fixture()
def store(tmp_path, tiny_store) -> Path:
    copy = tmp_path / "store"
    shutil.copytree(tiny_store, copy)
    return copy


def cli(*args):
    """(exit code, output) of the CLI; it must never print a traceback or call itself broken."""
    from typer.testing import CliRunner

    from ragkv.cli import app

    result = CliRunner().invoke(app, [str(a) for a in args])
    output = result.output or ""
    assert "Traceback" not in output and "internal error" not in output, output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    return result.exit_code, output


def one_error_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, output
    return lines[0]


def verifies(store: Path) -> bool:
    code, output = cli("verify", "--store", store)
    return code == 0 and "ok" in output


def first_answer(store: Path) -> list[int]:
    with ragkv.open(store, device="cpu") as engine:
        return engine.ask(QUESTIONS[0], max_new_tokens=6).token_ids


def test_a_huge_top_k_answers_with_what_the_store_holds(store):
    code, output = cli("ask", QUESTIONS[0], "--store", store, "--top-k", 1099511627776, "--max-new-tokens", 2)
    assert code == 0 and "but the store holds" in output


@pytest.mark.parametrize("question", ["rotate \udcff\udcfe key", "x \ud800"])
def test_a_question_that_is_not_utf8_is_one_line(store, question):
    code, output = cli("ask", question, "--store", store)
    assert code == 2 and "not valid UTF-8" in one_error_line(output)


def test_a_seed_past_64_bits_is_one_line(store):
    code, output = cli("ask", "x", "--store", store, "--temperature", "0.5", "--seed", 10**29)
    assert code == 2 and "--seed" in one_error_line(output)


@pytest.mark.parametrize("content", [b"\xff\xfe", b"-1\n", b"", b"1 2\n", "\u0661\n".encode(), b"0\n", b"7\n"])
def test_a_bad_current_is_exit_4_harms_nothing_and_repair_points_it_back(store, content):
    expected = first_answer(store)
    files = sorted(p.name for p in store.iterdir())
    (store / "CURRENT").write_bytes(content)
    for args in (("stats",), ("gc",), ("budget", "off"), ("verify",), ("ask", "x")):
        code, output = cli(*args, "--store", store)
        assert code == 4 and "CURRENT" in one_error_line(output), args
    assert sorted(p.name for p in store.iterdir()) == files  # no writer removed a generation
    code, output = cli("verify", "--repair", "--store", store)
    assert code == 0 and "it now names" in output
    assert verifies(store) and first_answer(store) == expected


def test_a_current_put_back_past_a_newer_generation_stops_writers(store, corpus, tiny_llama, tmp_path):
    from ragkv.store import open_snapshot

    docs = tmp_path / "docs"
    shutil.copytree(corpus, docs)
    with open_snapshot(store) as held:  # a reader keeps this generation on disk
        for version in range(2):
            (docs / "new.md").write_text(f"Generation notice {version}.")
            assert cli("ingest", docs, "--store", store, "--model", tiny_llama, "--device", "cpu")[0] == 0
        (store / "CURRENT").write_text(f"{held.generation}\n")  # put back by hand: two generations behind
        files = sorted(p.name for p in store.iterdir())
        code, output = cli("gc", "--store", store)
        assert code == 4 and "is newer" in one_error_line(output)
        assert sorted(p.name for p in store.iterdir()) == files  # the newer generations are intact
        code, output = cli("verify", "--repair", "--store", store)
        assert code == 0 and f"it now names {held.generation + 2}" in output


def test_a_damaged_vector_index_is_reported_and_rebuilt(store):
    expected = first_answer(store)
    index = next(store.glob("segments/*.faiss"))
    os.truncate(index, index.stat().st_size // 2)
    code, output = cli("ask", QUESTIONS[0], "--store", store)
    assert code == 4 and "verify --repair" in one_error_line(output)
    code, output = cli("verify", "--store", store)
    assert code == 4 and "vectors-unreadable" in output
    code, output = cli("verify", "--repair", "--store", store, "--device", "cpu")
    assert code == 0 and "chunks re-embedded" in output
    assert verifies(store) and first_answer(store) == expected


def test_repair_re_embeds_only_the_chunks_of_the_segment_that_is_damaged(store, corpus, tiny_llama, tmp_path):
    """Two segments (the first ingest's, then one more document's); the first is truncated:
    repair keeps the other as it is and re-embeds the first one's chunks, not the store's."""
    from ragkv.core.config import ModelSettings
    from ragkv.store import open_snapshot

    docs = tmp_path / "more"
    shutil.copytree(corpus, docs)
    (docs / "notice.md").write_text("Notice: the office is closed on Friday.")
    ragkv.ingest([docs], store, model=ModelSettings(model=str(tiny_llama), device="cpu"))
    with open_snapshot(store) as snap:
        first, second = snap.vectors.segments
        total = len(snap.vectors)
    expected = first_answer(store)
    kept = (store / "segments" / second.name).read_bytes()
    damaged = store / "segments" / first.name
    os.truncate(damaged, damaged.stat().st_size // 2)
    code, output = cli("verify", "--repair", "--json", "--store", store, "--device", "cpu")
    assert code == 0 and json.loads(output.splitlines()[0])["repair"]["chunks_reembedded"] == first.count < total
    with open_snapshot(store) as snap:
        assert second in snap.vectors.segments and (store / "segments" / second.name).read_bytes() == kept
        assert len(snap.vectors) == total
    assert verifies(store) and first_answer(store) == expected


def test_a_poisoned_hit_log_blocks_no_writer(store, corpus, tiny_llama):
    hits = store / "hits"
    hits.mkdir(exist_ok=True)
    (hits / "poison.jsonl").write_text(
        '{"doc": "keys.md", "i": Infinity, "src": "store", "t": 1.0}\n'
        '{"doc": "keys.md", "i": 99999999999, "src": "store", "t": 1.0}\n'
        '{"doc": "keys.md", "i": 0, "src": "store", "t": NaN}\n'
        '[1, 2]\n\xff\n{"doc": "keys.md", "i": 0, "src": "store", "t": 2.0}\n'
    )
    code, output = cli("verify", "--store", store)
    assert code == 0 and "hits/poison.jsonl: 5 lines record no use" in output
    code, output = cli("ingest", corpus, "--store", store, "--model", tiny_llama, "--device", "cpu")
    assert code == 0 and "hit logs: skipped 5 lines" in output
    code, output = cli("stats", "--store", store, "--json")
    assert code == 0 and json.loads(output)["uses"] >= 1  # the one real use was counted
    assert verifies(store)


def test_an_unopenable_shard_falls_back_and_verify_names_it(store, monkeypatch):
    expected = first_answer(store)
    shard = next((store / "shards").glob("*.safetensors"))
    real_open = os.open

    def no_permission(path, *args, **kwargs):
        if str(path) == str(shard):  # as root, chmod would not stop the read: refuse it here
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_permission)
    with ragkv.open(store, device="cpu") as engine:
        answer = engine.ask(QUESTIONS[0], max_new_tokens=6)
    assert answer.stats.mode == "fallback" and "Permission denied" in " ".join(answer.stats.warnings)
    code, output = cli("verify", "--store", store)
    assert code == 4 and "Permission denied" in output
    monkeypatch.undo()
    assert first_answer(store) == expected and verifies(store)


def test_shards_that_is_not_a_folder(store):
    shutil.rmtree(store / "shards")
    (store / "shards").write_text("x")
    code, output = cli("ask", QUESTIONS[0], "--store", store, "--max-new-tokens", 2)
    assert code == 0 and "full prefill" in output
    code, output = cli("verify", "--store", store)
    assert code == 4 and "Not a directory" in output
    for args in (("verify", "--repair"), ("gc",)):
        code, output = cli(*args, "--store", store)
        assert code == 4 and "shards is not a folder" in one_error_line(output)
    assert (store / "shards").read_text() == "x"  # nothing of the user's was moved or removed


def test_gc_on_a_corrupt_or_missing_catalog_is_exit_4_and_leaves_nothing(store):
    catalog = next(store.glob("catalog-*.duckdb"))
    catalog.write_bytes(b"garbage")
    code, output = cli("gc", "--store", store)
    assert code == 4 and "cannot open catalog" in one_error_line(output)
    assert not list(store.glob("*.partial"))
    catalog.unlink()
    code, output = cli("gc", "--store", store)
    assert code == 4 and "is missing" in one_error_line(output)


def test_batch_out_that_cannot_be_written(store, tmp_path):
    questions = tmp_path / "q.jsonl"
    questions.write_bytes(b'{"id": "a", "question": "When are salaries paid?"}\n{"id": "b", "question": "\xff"}\n')
    code, output = cli("batch", questions, "--out", tmp_path, "--store", store)
    assert code == 2 and "is a folder" in one_error_line(output)
    if Path("/dev/full").exists():
        code, output = cli("batch", questions, "--out", "/dev/full", "--store", store, "--max-new-tokens", 2)
        assert code == 7 and "No space left" in one_error_line(output)
    out = tmp_path / "a.jsonl"
    code, output = cli("batch", questions, "--out", out, "--store", store, "--max-new-tokens", 2)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert code == 0 and "1 answered, 1 errors" in output  # the bad line fails alone
    assert any("line 2: not UTF-8" in (line.get("error") or "") for line in lines)


def test_unreadable_and_odd_files_are_listed_not_fatal(tmp_path, monkeypatch):
    (tmp_path / "ok.md").write_text("Fine.")
    (tmp_path / "locked.md").write_text("secret")
    os.mkfifo(tmp_path / "pipe.md")
    (tmp_path / "dangling.md").symlink_to(tmp_path / "nowhere")
    (tmp_path / "big.txt").write_text("a" * 2048)
    (tmp_path / "records.jsonl").write_text(
        '{"id": "s", "text": "bad \\ud800"}\n{"id": "", "text": "t"}\n'
        '{"id": true, "text": "t"}\n{"id": "big", "text": "' + "b" * 2048 + '"}\n'
    )
    real = Path.read_bytes
    monkeypatch.setattr(
        Path,
        "read_bytes",
        lambda self: (
            (_ for _ in ()).throw(PermissionError(errno.EACCES, "Permission denied"))
            if self.name == "locked.md"
            else real(self)
        ),
    )
    found = read_documents([tmp_path], max_document_bytes=1024)
    reasons = {s.source.rsplit("/", 1)[-1]: s.reason for s in found.skipped}
    assert [d.doc_id for d in found.documents] == ["ok.md"]
    assert reasons["locked.md"] == "cannot be read: Permission denied"
    assert reasons["pipe.md"] == "not a regular file" and reasons["dangling.md"] == "a broken symbolic link"
    assert (
        "over the 1,024-byte limit" in reasons["big.txt"] and "over the 1,024-byte limit" in reasons["records.jsonl:4"]
    )
    assert "lone surrogate" in reasons["records.jsonl:1"]
    assert reasons["records.jsonl:2"].startswith('no "id"') and reasons["records.jsonl:3"].startswith('no "id"')


def test_the_same_ids_from_another_tree_replace_nothing(store, corpus, tiny_llama, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "faq.jsonl").write_text(
        '{"id": "wifi", "text": "The wifi is down for good."}\n{"id": "fresh", "text": "A new record."}\n'
    )
    shutil.copy(corpus / "keys.md", other / "keys.md")  # the same text from another file: unchanged
    code, output = cli("ingest", other, "--store", store, "--model", tiny_llama, "--device", "cpu", "--json")
    report = json.loads(output)
    assert code == 0 and report["documents"] == {"added": 1, "changed": 0, "unchanged": 1, "removed": 0}
    assert any("document id 'wifi' is stored from" in s["reason"] for s in report["skipped"])
    with ragkv.open(store, device="cpu") as engine:
        ((row, _),) = engine.retrieve("guest wifi password", doc_ids=["wifi"])
    assert "LumenGuest" in row.text  # the first tree's record is intact


def test_an_ingest_reports_every_stage_when_stderr_is_not_a_terminal(tmp_path, corpus, tiny_llama):
    code, output = cli("ingest", corpus, "--store", tmp_path / "s", "--model", tiny_llama, "--device", "cpu")
    stages = [line.split(":")[1].strip() for line in output.splitlines() if line.startswith("ragkv: ")]
    assert code == 0 and {"chunking", "embedding", "KV"} <= set(stages)
    assert any(line.startswith("ragkv: KV: ") and " in " in line for line in output.splitlines())  # its end


def test_usage_errors_are_one_line(store):
    for args in (("ask",), ("ask", "q", "--top-k", "x"), ("nosuch",), ("ask", "q", "--bogus")):
        code, output = cli(*args)
        assert code == 2 and "--help" in one_error_line(output) and "Usage:" not in output, args


def test_options_are_checked_before_the_model_loads(store, monkeypatch):
    import ragkv.engine.active

    monkeypatch.setattr(ragkv.engine.active, "load_model", lambda *a, **k: pytest.fail("loaded the model first"))
    for args, fragment in (
        (("serve", "--port", 70000), "--port"),
        (("serve", "--port", -1), "--port"),
        (("ask", "x", "--device", "cuda"), "CUDA"),
        (("ask", "x", "--kv-dtype", "int4"), "int4"),
        (("budget", "9" * 30 + "TB"), "largest size"),
    ):
        if fragment == "CUDA" and __import__("torch").cuda.is_available():
            continue
        code, output = cli(*args, "--store", store)
        assert code in (2, 6) and fragment in one_error_line(output), args
