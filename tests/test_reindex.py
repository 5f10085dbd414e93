"""Nightly re-index: prune, model changes, gc, verify and repair, schema migrations, and the
bad-input cases of a store that must survive anything."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from contextlib import contextmanager

import pytest

import ragkv
from ragkv.core.errors import ModelError, StoreFormatError
from ragkv.core.keys import KVKey
from ragkv.store import SealedEntry, StoreWriter, collect_garbage, open_snapshot, verify
from ragkv.store.catalog import schema as catalog_schema
from ragkv.store.generations import read_current
from tests.conftest import QUESTIONS, ROOT, build_store, flip_bit_of_entry, run_cli
from tests.test_exactness import assert_cached_equals_full


@pytest.fixture
def docs(corpus, tmp_path):
    folder = tmp_path / "docs"
    shutil.copytree(corpus, folder)
    return folder


@pytest.fixture
def store(tiny_store, tmp_path):
    folder = tmp_path / "store"
    shutil.copytree(tiny_store, folder)
    return folder


def reindex_json(docs, store, *options):
    result = run_cli("reindex", docs, "--store", store, "--json", *options)
    return result.exit_code, json.loads(result.stdout)


def test_reindex_adds_changes_removes_and_reports(docs, store, tiny_llama):
    code, report = reindex_json(docs, store, "--model", tiny_llama)
    assert code == 0 and report["ok"]
    assert report["ingest"]["documents"] == {"added": 0, "changed": 0, "unchanged": 6, "removed": 0}
    assert report["ingest"]["tokens_computed"] == 0 and report["ingest"]["tokens_skipped"] > 0

    (docs / "keys.md").write_text("Keys are rotated by the platform team every 30 days.")
    (docs / "leave.txt").unlink()
    (docs / "new.md").write_text("The cafeteria serves lunch from noon to two.")
    code, report = reindex_json(docs, store, "--model", tiny_llama)
    assert code == 0 and report["verify"]["ok"]
    assert report["ingest"]["documents"] == {"added": 1, "changed": 1, "unchanged": 4, "removed": 1}
    assert report["ingest"]["kv_computed"] == 2
    assert report["gc"]["entries_removed"] == 2  # the old keys.md chunk and the leave.txt chunk
    with ragkv.open(store, device="cpu") as engine:
        docs_now = {row.doc_id for row, _ in engine.retrieve("leave", top_k=10)}
        assert "leave.txt" not in docs_now and "new.md" in docs_now
        assert len(engine.snapshot.vectors) == engine.snapshot.catalog.reports.counts()["chunks"] == 6
    assert_cached_equals_full(store, QUESTIONS[:2], max_new_tokens=8)


@pytest.mark.slow  # a subprocess loads the models
def test_the_nightly_command_writes_its_report_and_exit_code(docs, store, tiny_llama, tmp_path):
    report_file = tmp_path / "report.json"
    cmd = [
        sys.executable,
        "-m",
        "ragkv",
        "reindex",
        str(docs),
        "--store",
        str(store),
        "--model",
        str(tiny_llama),
        "--report",
        str(report_file),
        "--quiet",
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    report = json.loads(report_file.read_text())
    assert report["ok"] and report["ingest"]["tokens_computed"] == 0 and "removed" in report["ingest"]["documents"]
    done = subprocess.run(cmd[:4] + [str(tmp_path / "missing")] + cmd[5:], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.startswith("error: ")


def test_a_new_model_recomputes_everything_and_the_old_one_keeps_working(docs, store, tiny_llama, tiny_qwen2):
    report = build_store(docs, store, str(tiny_qwen2))
    assert report.documents["unchanged"] == 6 and report.chunks_embedded == 0  # chunks and vectors reused
    assert report.kv_computed == 6
    with ragkv.open(store, device="cpu") as engine:
        assert engine.lm.facts.name == str(tiny_qwen2)  # the last ingested model is the default
    with ragkv.open(store, model=str(tiny_llama), device="cpu") as engine:
        assert engine.ask(QUESTIONS[0], max_new_tokens=4).stats.mode == "exact"
    gc = collect_garbage(store, other_models=True)
    assert gc.profiles_dropped == 1 and gc.bytes_reclaimed > 0
    with pytest.raises(ModelError, match="has no KV for model"):
        ragkv.open(store, model=str(tiny_llama), device="cpu")
    assert_cached_equals_full(store, QUESTIONS[:2], max_new_tokens=8)


def test_gc_reclaims_space_and_keeps_everything_live_exact(tiny_llama, tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(12):
        (docs / f"d{i}.md").write_text(f"Service {i} restarts nightly at {i}:00 and pages team {i % 3}.")
    build_store(docs, tmp_path / "s", str(tiny_llama), shard_bytes=8 * 1024)  # a few entries per shard
    for i in range(9):
        (docs / f"d{i}.md").unlink()
    build_store(docs, tmp_path / "s", str(tiny_llama), prune=True)
    shards = tmp_path / "s" / "shards"
    before = sum(p.stat().st_size for p in shards.iterdir())
    report = collect_garbage(tmp_path / "s")
    after = sum(p.stat().st_size for p in shards.iterdir())
    assert report.entries_removed == 9 and report.shards_rewritten + report.shards_deleted > 0
    assert report.bytes_reclaimed == before - after > 0
    with open_snapshot(tmp_path / "s") as snap:
        assert verify(snap).ok
        assert snap.catalog.reports.counts()["documents"] == 3
    assert_cached_equals_full(
        tmp_path / "s", ["When does service 10 restart?", "Which team does service 11 page?"], max_new_tokens=8
    )
    assert collect_garbage(tmp_path / "s").bytes_reclaimed == 0  # nothing left to reclaim


def test_gc_never_deletes_what_a_reader_still_uses(docs, store, tiny_llama):
    reader = ragkv.open(store, device="cpu")
    expected = reader.ask(QUESTIONS[0], max_new_tokens=6)
    for path in docs.iterdir():
        path.unlink()
    (docs / "other.md").write_text("Completely different content about parking.")
    code, report = reindex_json(docs, store, "--model", tiny_llama)
    assert code == 0 and report["gc"]["generations_kept_for_readers"] == [1]
    again = reader.ask(QUESTIONS[0], max_new_tokens=6)  # still on generation 1, still cached
    assert again.stats.mode == "exact" and again.token_ids == expected.token_ids
    assert reader.refresh() and reader.snapshot.generation == read_current(store)
    reader.close()
    later = collect_garbage(store)
    assert 1 in later.generations_removed and later.bytes_reclaimed > 0


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_verify_finds_damage_and_repair_fixes_it(store, damage):
    with open_snapshot(store) as snap:
        (key,) = snap.catalog.con.execute("SELECT kv_key FROM kv_entries WHERE kind = 'chunk' LIMIT 1").fetchone()
        entry = snap.catalog.entries.entry(key)
    shard = store / "shards" / entry.shard
    if damage == "flip":
        flip_bit_of_entry(shard, entry.tensor)
    elif damage == "truncate":  # cut the file in the middle of this entry's bytes
        data = shard.read_bytes()
        header = int.from_bytes(data[:8], "little")
        begin, end = json.loads(data[8 : 8 + header])[entry.tensor]["data_offsets"]
        shard.write_bytes(data[: 8 + header + (begin + end) // 2])
    else:
        shard.unlink()
    result = run_cli("verify", "--store", store, "--json")
    report = json.loads(result.stdout)
    assert result.exit_code == 4 and not report["ok"]
    assert entry.kv_key in {p["kv_key"] for p in report["problems"]}
    result = run_cli("verify", "--store", store, "--repair")
    assert result.exit_code == 0, result.stdout
    assert "entries recomputed" in result.stdout and "ok" in result.stdout
    assert_cached_equals_full(store, QUESTIONS, max_new_tokens=8)


def test_an_older_catalog_is_migrated_by_a_writer_and_refused_by_readers(store, monkeypatch):
    extra = ("0002_test_column", "ALTER TABLE documents ADD COLUMN test_note VARCHAR;")
    monkeypatch.setattr(catalog_schema, "MIGRATIONS", catalog_schema.MIGRATIONS + [extra])
    with pytest.raises(StoreFormatError, match="0002_test_column"):
        open_snapshot(store)
    with StoreWriter(store) as writer:
        assert json.loads(writer.catalog.meta()["migrations"])[-1] == "0002_test_column"
    with open_snapshot(store) as snap:
        assert snap.catalog.con.execute("SELECT count(test_note) FROM documents").fetchone() == (0,)


def test_a_second_writer_fails_fast_or_waits(store):
    holder = StoreWriter(store)
    result = run_cli("gc", "--store", store)
    assert result.exit_code == 5 and f"pid {os.getpid()}" in result.stderr
    waiter = subprocess.Popen(
        [sys.executable, "-m", "ragkv", "gc", "--store", str(store), "--wait"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    said = waiter.stderr.readline()  # queued behind the holder, and says so
    assert f"pid {os.getpid()}" in said and "waiting" in said and waiter.poll() is None
    holder.abort()
    assert waiter.wait() == 0


def test_hostile_ids_and_catalog_rows_cannot_escape(tiny_llama, tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    hostile = ["../../etc/passwd", "x'); DROP TABLE chunks; --", "/abs/path", "null\\u0000byte"]
    (docs / "h.jsonl").write_text(
        "\n".join(json.dumps({"id": i, "text": f"Record {n} text.", "meta": i}) for n, i in enumerate(hostile))
    )
    build_store(docs, tmp_path / "s", str(tiny_llama))
    with open_snapshot(tmp_path / "s") as snap:
        assert sorted(snap.catalog.documents.all()) == sorted(hostile)
        assert verify(snap).ok
    assert not (tmp_path / "etc").exists()
    # A catalog row naming a path outside the shard folder is refused, and the query falls back.
    with StoreWriter(tmp_path / "s") as writer:
        chunk_entries = [e for e in writer.catalog.reports.all_entries() if not KVKey.from_string(e.kv_key).is_prefix]
        writer.catalog.entries.move_entries(
            [
                SealedEntry(e.kv_key, "../../../etc/passwd", e.num_tokens, e.dtype, e.nbytes, e.checksum)
                for e in chunk_entries
            ]
        )
    with ragkv.open(tmp_path / "s", device="cpu") as engine:
        answer = engine.ask("Record 1", max_new_tokens=2)
    assert answer.stats.mode == "fallback" and "invalid shard file" in answer.stats.warnings[0]


INGEST_MORE = textwrap.dedent("""
    import resource, signal, sys
    sys.path.insert(0, {root!r})
    {limit}
    from ragkv.cli import main
    sys.argv = ["ragkv", "ingest", {docs!r}, "--store", {store!r}, "--model", {model!r}]
    main()
""")


@contextmanager
def tmpfs(path, size_bytes: int):
    path.mkdir()
    if (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("mounting a tmpfs needs privileges this machine does not give")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def ingest_more_and_check(docs, store, tiny_llama, limit=""):
    """Ingest 20 more documents into `store` in a subprocess expected to fail writing; the
    failure is one line, and the published store still verifies and answers exactly."""
    for i in range(20):
        (docs / f"more-{i}.md").write_text(f"Additional document {i} about topic {i}. " * 20)
    published = read_current(store)
    script = INGEST_MORE.format(root=str(ROOT), docs=str(docs), store=str(store), model=str(tiny_llama), limit=limit)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 7, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "cannot write store" in errors[0] and "unchanged" in errors[0], done.stderr
    assert read_current(store) == published
    with open_snapshot(store) as snap:
        assert verify(snap).ok
    assert_cached_equals_full(store, QUESTIONS[:1], max_new_tokens=4)


@pytest.mark.slow  # a subprocess loads the models
def test_a_read_only_store_gets_one_line_and_keeps_serving(docs, tiny_store, tiny_llama, tmp_path):
    with tmpfs(tmp_path / "ro", 64 << 20) as mount:
        shutil.copytree(tiny_store, mount / "store")
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
        ingest_more_and_check(docs, mount / "store", tiny_llama)


@pytest.mark.slow  # a subprocess loads the models
def test_a_full_disk_gets_one_line_and_keeps_serving(docs, tiny_store, tiny_llama, tmp_path):
    size = sum(p.stat().st_size for p in tiny_store.rglob("*") if p.is_file())
    with tmpfs(tmp_path / "full", 2 * size + (64 << 10)) as mount:  # room for the catalog copy, not for much more
        shutil.copytree(tiny_store, mount / "store")
        ingest_more_and_check(docs, mount / "store", tiny_llama)
        assert not list((mount / "store").glob("*.partial"))  # the failed write cleaned up after itself


@pytest.mark.slow  # a subprocess loads the models
def test_a_file_size_limit_mid_write_gets_one_line_and_keeps_serving(docs, store, tiny_llama):
    catalog_bytes = max(p.stat().st_size for p in store.glob("catalog-*.duckdb"))
    limit = catalog_bytes + 4096  # the catalog copy fits; growing it, or a shard, does not
    ingest_more_and_check(
        docs,
        store,
        tiny_llama,
        limit=(
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))"
        ),
    )


@pytest.mark.parametrize("change", [{"system_prompt": "You answer in one short sentence."}, {"dtype": "bfloat16"}])
def test_a_new_system_prompt_or_dtype_recomputes_kv_but_not_chunks(change, docs, store, tiny_llama):
    settings = {k: v for k, v in change.items() if k != "dtype"}
    report = build_store(docs, store, str(tiny_llama), dtype=change.get("dtype", "float32"), **settings)
    assert report.documents["unchanged"] == 6 and report.chunks_embedded == 0
    assert report.kv_computed == 6 and report.kv_reused == 0
    with open_snapshot(store) as snap:
        assert len(snap.catalog.entries.profiles()) == 2
