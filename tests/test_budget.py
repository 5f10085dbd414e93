"""Corpus scale: KV computed on a miss (token-identical), written back in the background
within a budget, popularity that survives restarts, eviction, and the faults around them."""

from __future__ import annotations

import errno
import json
import logging
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import ragkv
from ragkv.core.errors import InputError
from ragkv.store import open_snapshot, verify
from ragkv.store.catalog import Catalog
from ragkv.store.kv.budget import Candidate, plan
from ragkv.store.kv.popularity import HITS_DIR, HitLog, Use, decay, read_pending
from ragkv.store.kv.shards import ShardWriter, shard_files
from ragkv.store.stats import store_stats
from tests.conftest import QUESTIONS, ROOT, build_store, computed_kv_of, run_cli


# -- the budget's choice ---------------------------------------------------------------------
def test_plan_keeps_the_most_popular_and_prefers_what_is_stored_on_ties():
    candidates = [
        Candidate("cold-stored", 10, 0.0, True, 0),
        Candidate("hot-new", 10, 5.0, False, 1),
        Candidate("warm-stored", 10, 2.0, True, 2),
        Candidate("cold-new", 10, 0.0, False, 3),
    ]
    decision = plan(candidates, room=20)
    assert decision.keep == ["warm-stored"] and decision.compute == ["hot-new"] and decision.evict == ["cold-stored"]
    tie = plan([Candidate("new", 10, 1.0, False, 0), Candidate("stored", 10, 1.0, True, 1)], room=10)
    assert tie.keep == ["stored"] and tie.compute == []


def test_plan_fills_gaps_with_smaller_chunks_and_caps_new_bytes():
    candidates = [Candidate("big", 30, 3.0, False, 0), Candidate("small", 5, 1.0, False, 1)]
    assert plan(candidates, room=20).compute == ["small"]
    assert plan(candidates, room=None).compute == ["big", "small"]
    assert plan(candidates, room=None, compute_limit=30).compute == ["big"]
    assert plan(candidates, room=None, compute_limit=0).compute == []


def test_plan_keeps_each_span_a_prefix_of_itself():
    # a span a -> b -> c stored, scored by path (never rising along it), and a new chunk alone
    span = [
        Candidate("a", 10, 3.0, True, 0),
        Candidate("b", 10, 3.0, True, 1, parent="a"),
        Candidate("c", 10, 1.0, True, 2, parent="b"),
    ]
    decision = plan([*span, Candidate("alone", 10, 2.0, False, 3)], room=30)
    assert decision.keep == ["a", "b"] and decision.compute == ["alone"] and decision.evict == ["c"]  # tail first
    # a continuation ranked before its parent (stored wins the tie) waits for it, and falls with it
    waits = plan([Candidate("child", 10, 1.0, True, 1, parent="p"), Candidate("p", 10, 1.0, False, 0)], room=20)
    assert waits.compute == ["p"] and waits.keep == ["child"]
    falls = plan([Candidate("child", 5, 1.0, True, 1, parent="p"), Candidate("p", 30, 1.0, False, 0)], room=20)
    assert falls.compute == [] and falls.evict == ["child"]
    # an entry whose parent has no KV is unusable: dropped even with room to spare
    assert plan([Candidate("orphan", 1, 9.0, True, 0, parent="gone")], room=None).evict == ["orphan"]


def test_scores_age_by_half_life():
    assert decay(4.0, since=100.0, now=100.0 + 3600, half_life_s=3600) == pytest.approx(2.0)
    assert decay(4.0, since=100.0, now=50.0, half_life_s=3600) == 4.0  # a clock step back ages nothing


# -- the hit log -----------------------------------------------------------------------------
def test_hit_log_folds_once_and_its_file_goes_when_its_reader_has(tmp_path):
    log = HitLog(tmp_path)
    log.record([Use("a", 0, "computed"), Use("a", 0, "store"), Use("b", 1, "ram")])
    (file,) = (tmp_path / HITS_DIR).iterdir()
    with open(file, "ab") as f:
        f.write(b'{"t": 1, "doc": "torn')  # a line a killed reader never finished
    catalog = Catalog(tmp_path / "c.duckdb", read_only=False)
    pending = read_pending(tmp_path, catalog.usage.folded_offsets())
    assert catalog.usage.fold_uses(pending, 3600.0) == 3 and pending.finished == []
    rows = catalog.usage.chunk_hits()
    assert (rows[("a", 0)].hits, rows[("a", 0)].misses, rows[("a", 0)].uses) == (1, 1, 2)
    assert rows[("b", 1)].hits == 1 and rows[("a", 0)].score == pytest.approx(2.0)
    assert catalog.usage.fold_uses(read_pending(tmp_path, catalog.usage.folded_offsets()), 3600.0) == 0  # nothing twice
    log.close()
    pending = read_pending(tmp_path, catalog.usage.folded_offsets())
    assert pending.finished == [] and pending.uses == []  # the torn tail is not "folded in full"
    catalog.close()


def test_pending_hits_fold_once_even_when_a_fold_dies_before_deleting_them(tiny_llama, corpus, tmp_path, monkeypatch):
    """A reader that does not write the store leaves its uses as hits objects; a fold counts
    each use once, also when the fold before it published and died before deleting them."""
    from ragkv.store.kv.pending import HITS_SUFFIX
    from ragkv.store.kv.pending_hits import PendingHits
    from ragkv.store.kv.writeback import FoldReport, fold

    build_store(corpus, tmp_path / "s", str(tiny_llama), precompute=0)
    root = tmp_path / "s"
    hits = PendingHits(root, flush_s=3600.0)
    hits.record([Use("keys.md", 0, "computed"), Use("keys.md", 0, "store")])
    assert not (root / "pending").exists()  # buffered: nothing left before a flush
    hits.record([Use("keys.md", 1, "ram")])
    hits.close()
    (name,) = [p.name for p in (root / "pending").iterdir()]
    assert name.endswith(HITS_SUFFIX) and hits.objects == 1
    with open_snapshot(root) as snapshot:  # stats count uses not folded yet
        assert (found := store_stats(snapshot))["pending_hit_objects"] == 1 and found["kv_hits"] == 2
    with monkeypatch.context() as patched:  # killed after publishing, before deleting
        patched.setattr(FoldReport, "delete_folded", lambda self: None)
        report = fold(root)
    assert (report.uses_folded, report.hit_objects) == (3, 1) and (root / "pending" / name).exists()
    report = fold(root)
    assert (report.uses_folded, report.hit_objects) == (0, 1) and not list((root / "pending").iterdir())
    with open_snapshot(root) as snapshot:
        rows = snapshot.catalog.usage.chunk_hits()
        assert (rows[("keys.md", 0)].uses, rows[("keys.md", 0)].hits, rows[("keys.md", 1)].hits) == (2, 1, 1)
        assert name in snapshot.catalog.usage.folded_offsets()
    assert fold(root).generation == report.generation  # the object is gone; forgetting it changes nothing yet
    hits = PendingHits(root)
    hits.record([Use("keys.md", 2, "store")])
    hits.close()
    fold(root)  # with the next uses, its offset is forgotten
    with open_snapshot(root) as snapshot:
        assert name not in snapshot.catalog.usage.folded_offsets() and len(snapshot.catalog.usage.folded_offsets()) == 1


def test_uses_a_process_buffered_are_left_when_it_exits_without_closing(tmp_path):
    """An engine embedded in another (vLLM's offline LLM never closes its connector) still
    leaves its last uses: at the process's exit, before the timer would have."""
    from ragkv.store.kv.pending import HITS_SUFFIX

    script = (
        "import sys; sys.path.insert(0, sys.argv[2])\n"
        "from ragkv.store.kv.pending_hits import PendingHits\n"
        "from ragkv.store.kv.popularity import Use\n"
        "PendingHits(sys.argv[1], flush_s=3600.0).record([Use('keys.md', 0, 'computed')])\n"
    )
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path), str(ROOT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    (left,) = (tmp_path / "pending").iterdir()
    assert left.name.endswith(HITS_SUFFIX) and '"keys.md"' in left.read_text()


def test_folder_replicas_that_leave_pending_never_take_the_lock_and_find_each_others_kv(stores):
    """On a folder shared by machines, replicas opened with leave_pending learn as on S3: a
    miss's KV goes under pending/ even while a writer holds the store, another replica reads
    it from there instead of computing it, and a fold stores it."""
    from ragkv.store.kv.writeback import fold
    from ragkv.store.writer import open_writer

    _, lazy = stores
    with open_writer(lazy):  # an ingest holds the store throughout
        answers = []
        for _ in ("replica a", "replica b"):
            with ragkv.open(lazy, device="cpu", leave_pending=True) as engine:
                answer = engine.ask(QUESTIONS[0], max_new_tokens=6, context="chunk")
                engine.flush()
                answers.append(answer)
        assert answers[0].stats.kv_source == "computed" and answers[1].stats.kv_source == "store"
        assert answers[0].token_ids == answers[1].token_ids
        assert sorted(p.suffix for p in (lazy / "pending").iterdir()) == [".json", ".safetensors"]
    report = fold(lazy)  # their uses: in hits/, which a folder's readers append to without the lock
    assert (report.objects, report.stored, report.uses_folded) == (1, 1, 2)
    with ragkv.open(lazy, device="cpu", write_back=False) as engine:
        again = engine.ask(QUESTIONS[0], max_new_tokens=6, context="chunk")
        full = engine.ask(QUESTIONS[0], max_new_tokens=6, context="chunk", use_cache=False)
    assert again.stats.kv_source == "store" and again.token_ids == full.token_ids == answers[0].token_ids


def test_a_writer_replica_folds_only_when_readers_left_something_and_the_store_is_free(tiny_llama, corpus, tmp_path):
    from ragkv.store.kv.pending_hits import PendingHits
    from ragkv.store.kv.writeback import FoldLoop
    from ragkv.store.writer import open_writer

    build_store(corpus, tmp_path / "s", str(tiny_llama), precompute=0)
    root = tmp_path / "s"
    loop = FoldLoop(root, every_s=3600.0)
    assert loop.fold_once() is None and loop.folds == 0  # nothing left: no generation published
    hits = PendingHits(root)
    hits.record([Use("keys.md", 0, "computed")])
    hits.close()
    with open_writer(root):  # an ingest holds the store: this round is skipped
        assert loop.fold_once() is None and loop.folds == 0
    report = loop.fold_once()
    assert report is not None and report.uses_folded == 1 and loop.folds == 1
    assert loop.fold_once() is None  # folded and deleted: nothing again
    result = run_cli("serve", "--store", str(root), "--writer", "--fold-every", "0")
    assert result.exit_code == 2 and "--fold-every must be more than 0 seconds" in result.output


# -- KV computed on a miss -------------------------------------------------------------------
@pytest.fixture()
def stores(tiny_llama, corpus, tmp_path):
    """The corpus ingested twice: every chunk's KV (full), and none of it (lazy)."""
    build_store(corpus, tmp_path / "full", str(tiny_llama))
    report = build_store(corpus, tmp_path / "lazy", str(tiny_llama), precompute=0)
    assert report.kv_computed == 0 and report.kv_deferred == 6
    return tmp_path / "full", tmp_path / "lazy"


def test_a_miss_computes_the_kv_token_identical_then_the_store_serves_it(stores):
    full, lazy = stores
    with ragkv.open(full, device="cpu") as stored, ragkv.open(lazy, device="cpu", ram_bytes=0) as engine:
        for question in QUESTIONS:
            want = stored.ask(question, max_new_tokens=12)
            got = engine.ask(question, max_new_tokens=12)
            assert got.token_ids == want.token_ids and want.stats.kv_source == "store"
            assert got.stats.kv_source == "computed" and got.stats.mode == "exact"
            assert got.stats.computed_tokens == len(got.prompt_ids) - len(engine.active.layout.prefix_ids)
            torch.testing.assert_close(
                engine.first_token_logits(question), stored.first_token_logits(question), rtol=1e-4, atol=1e-4
            )
        engine.flush()
        assert engine.loader.writer.report.stored == 4
        assert engine.refresh()
        again = engine.ask(QUESTIONS[0], max_new_tokens=12)
        assert (
            again.stats.kv_source == "store"
            and again.token_ids == stored.ask(QUESTIONS[0], max_new_tokens=12).token_ids
        )
    with open_snapshot(lazy) as snapshot:
        assert verify(snapshot).ok
        assert snapshot.catalog.reports.counts()["kv_entries"] == 5  # the prefix and the four chunks asked about


def test_ram_serves_a_repeat_miss_before_the_write_lands(stores):
    _, lazy = stores
    with ragkv.open(lazy, device="cpu", write_back=False) as engine:
        first = engine.ask(QUESTIONS[1], max_new_tokens=6)
        second = engine.ask(QUESTIONS[1], max_new_tokens=6)
        assert (first.stats.kv_source, second.stats.kv_source) == ("computed", "ram")
        assert first.token_ids == second.token_ids
        assert json.loads(json.dumps(second.to_dict()))["stats"]["kv_source"] == "ram"
    with open_snapshot(lazy) as snapshot:  # write_back=False: nothing stored
        assert snapshot.catalog.reports.counts()["kv_entries"] == 1


def test_uses_survive_a_restart_and_stats_report_the_hit_rate(stores):
    _, lazy = stores
    for _ in range(2):  # two processes' worth of engines: the second finds the first's KV
        with ragkv.open(lazy, device="cpu") as engine:
            engine.ask(QUESTIONS[0], max_new_tokens=2)
    result = run_cli("stats", "--store", lazy, "--json")
    summary = json.loads(result.stdout)
    assert (summary["uses"], summary["kv_hits"], summary["kv_misses"], summary["hit_rate"]) == (2, 1, 1, 0.5)
    assert summary["hottest"][0]["doc_id"] == "keys.md" and summary["hottest"][0]["uses"] == 2
    text = run_cli("stats", "--store", lazy).stdout
    assert "hit rate 50.0%" in text and "hottest: keys.md (2 uses" in text


# -- the budget ------------------------------------------------------------------------------
def _entry_bytes(store) -> tuple[int, int]:
    """(prefix bytes, largest chunk entry bytes) of a store."""
    with open_snapshot(store) as snapshot:
        return snapshot.catalog.reports.prefix_bytes(), max(e.nbytes for e in snapshot.catalog.reports.all_entries())


def test_a_budget_keeps_the_most_asked_chunks_within_its_bytes(stores, tiny_llama, corpus, tmp_path):
    full, _ = stores
    prefix, largest = _entry_bytes(full)
    limit = prefix + 2 * largest  # room for two chunks at least, not for all six
    report = build_store(corpus, tmp_path / "b", str(tiny_llama), kv_budget=limit)
    assert report.kv_bytes <= limit and 2 <= report.kv_computed < 6 and report.kv_deferred == 6 - report.kv_computed
    hot = "How do I rotate the API key?"
    with ragkv.open(tmp_path / "b", device="cpu", ram_bytes=0) as engine:
        for _ in range(3):
            engine.ask(hot, max_new_tokens=1)
            engine.flush()
            engine.refresh()
        assert engine.ask(hot, max_new_tokens=1).stats.kv_source == "store"
        with_kv = engine.snapshot.catalog.reports.kv_bytes()
        assert with_kv <= limit
        ((row, _),) = engine.retrieve(hot)
        assert row.entry is not None  # the hot chunk holds a place
    # A smaller budget evicts down to the hot chunk; below the prefix it is refused.
    result = run_cli("budget", prefix + largest, "--store", tmp_path / "b", "--json")
    summary = json.loads(result.stdout)
    assert summary["kv_bytes"] <= prefix + largest and summary["evicted"] >= 1
    with ragkv.open(tmp_path / "b", device="cpu") as engine:
        assert engine.ask(hot, max_new_tokens=1).stats.kv_source == "store"
    with open_snapshot(tmp_path / "b") as snapshot:
        assert verify(snapshot).ok and snapshot.catalog.usage.kv_budget() == prefix + largest
        assert sum(shard_files(tmp_path / "b" / "shards").values()) <= summary["kv_bytes"] + 64 * 1024
    bad = run_cli("budget", "1KB", "--store", tmp_path / "b")
    assert bad.exit_code != 0 and "smaller than the system prompt's KV" in bad.output
    assert len(bad.output.strip().splitlines()) == 1
    assert json.loads(run_cli("budget", "--store", tmp_path / "b", "--json").stdout)["kv_budget"] == prefix + largest


def test_ingest_refuses_a_budget_below_the_prefix_and_leaves_the_store(tiny_llama, corpus, tmp_path):
    build_store(corpus, tmp_path / "s", str(tiny_llama))
    with open_snapshot(tmp_path / "s") as snapshot:
        generation = snapshot.generation
    with pytest.raises(InputError, match="smaller than the system prompt's KV"):
        build_store(corpus, tmp_path / "s", str(tiny_llama), kv_budget=1000)
    with open_snapshot(tmp_path / "s") as snapshot:
        assert snapshot.generation == generation and snapshot.catalog.usage.kv_budget() is None
    result = run_cli("ingest", corpus, "--store", tmp_path / "s", "--kv-budget", "lots", "--model", tiny_llama)
    assert result.exit_code != 0 and "--kv-budget 'lots' is not a size" in result.output


def test_reingest_recomputes_a_changed_hot_document_before_cold_ones(stores, tiny_llama, corpus, tmp_path):
    full, _ = stores
    prefix, _ = _entry_bytes(full)
    with open_snapshot(full) as snapshot:
        per_token = prefix // len(snapshot.catalog.entries.profiles()[0].prefix_ids)
    limit = prefix + 30 * per_token  # room for one of the two changed chunks (about 20 tokens each)
    docs = tmp_path / "docs"
    shutil.copytree(corpus, docs)
    build_store(docs, tmp_path / "b", str(tiny_llama), kv_budget=limit, precompute=0)
    with ragkv.open(tmp_path / "b", device="cpu", write_back=False) as engine:
        for _ in range(3):
            engine.ask("How many days of annual leave do I get?", max_new_tokens=1)
    (docs / "leave.txt").write_text("Annual leave is 30 days per year, approved by your manager in the HR portal.")
    (docs / "keys.md").write_text("API keys are rotated by the platform team on request, after a ticket to security.")
    report = build_store(docs, tmp_path / "b", str(tiny_llama), prune=True)  # the nightly job's ingest
    assert report.documents["changed"] == 2 and report.kv_computed == 1 and report.kv_budget == limit
    with ragkv.open(tmp_path / "b", device="cpu") as engine:
        ((row, _),) = engine.retrieve("How many days of annual leave do I get?")
        assert row.doc_id == "leave.txt" and row.entry is not None  # inherited its old chunk's popularity
        ((row, _),) = engine.retrieve("Who rotates API keys?")
        assert row.doc_id == "keys.md" and row.entry is None


# -- faults ----------------------------------------------------------------------------------
def test_concurrent_misses_of_one_chunk_store_one_entry(stores):
    _, lazy = stores
    with ragkv.open(lazy, device="cpu") as a, ragkv.open(lazy, device="cpu") as b:
        assert a.ask(QUESTIONS[2], max_new_tokens=1).stats.kv_source == "computed"
        assert b.ask(QUESTIONS[2], max_new_tokens=1).stats.kv_source == "computed"
        a.flush()
        b.flush()
        assert a.loader.writer.report.stored + b.loader.writer.report.stored == 1
        assert a.loader.writer.report.linked + b.loader.writer.report.linked == 1
    with open_snapshot(lazy) as snapshot:
        assert snapshot.catalog.reports.counts()["kv_entries"] == 2 and verify(snapshot).ok
        assert len(shard_files(lazy / "shards")) == 2  # the prefix's shard and one chunk shard


WRITE_BACK_KILLED = textwrap.dedent("""
    import sys, threading
    sys.path.insert(0, {root!r})
    import ragkv
    from tests.faults import kill_after_sealing_a_shard
    engine = ragkv.open({store!r}, device="cpu")
    printed = threading.Event()  # the write-back runs behind the answer: it dies only after the print
    kill_after_sealing_a_shard(not_before=printed)
    print(engine.ask({question!r}, max_new_tokens=1).stats.kv_source, flush=True)
    printed.set()
    engine.close()  # waits for the write-back, which kills this process after sealing its shard
    print("not killed", flush=True)
""")


def test_a_kill_during_write_back_leaves_a_store_that_verifies(stores):
    _, lazy = stores
    script = WRITE_BACK_KILLED.format(root=str(ROOT), store=str(lazy), question=QUESTIONS[3])
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == -9 and proc.stdout.split() == ["computed"], proc.stderr[-2000:]
    assert len(shard_files(lazy / "shards")) == 2  # the sealed, never committed shard is an orphan
    with open_snapshot(lazy) as snapshot:
        assert verify(snapshot).ok and snapshot.catalog.reports.counts()["kv_entries"] == 1
    with ragkv.open(lazy, device="cpu") as engine:
        assert engine.ask(QUESTIONS[3], max_new_tokens=1).stats.kv_source == "computed"
    with open_snapshot(lazy) as snapshot:  # stored now; the next writer deleted the orphan
        assert verify(snapshot).ok and snapshot.catalog.reports.counts()["kv_entries"] == 2
        assert set(shard_files(lazy / "shards")) == snapshot.catalog.reports.shards()


def test_a_full_disk_during_write_back_warns_once_and_answers_go_on(stores, monkeypatch, caplog):
    _, lazy = stores

    def full(self):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ShardWriter, "flush", full)
    with caplog.at_level(logging.WARNING, logger="ragkv"), ragkv.open(lazy, device="cpu") as engine:
        for question in QUESTIONS[:3]:
            answer = engine.ask(question, max_new_tokens=2)
            assert answer.stats.kv_source == "computed" and answer.token_ids
            engine.flush()
        assert engine.loader.writer.report.failures == 3
    warnings = [r for r in caplog.records if "could not store computed KV" in r.getMessage()]
    assert len(warnings) == 1 and "No space left on device" in warnings[0].getMessage()
    with open_snapshot(lazy) as snapshot:
        assert verify(snapshot).ok and snapshot.catalog.reports.counts()["kv_entries"] == 1


def test_a_fold_stores_pending_kv_once_and_leaves_nothing_partial(stores, monkeypatch):
    """KV left pending by two readers (as on S3) is folded once per key; an object whose
    manifest never came is never taken, and goes once old."""
    import ragkv.store.kv.pending as pending_module
    from ragkv.store.kv.pending import PendingWriter
    from ragkv.store.kv.writeback import fold

    full, lazy = stores
    batch, rows = computed_kv_of(full)
    for _ in range(2):  # two readers computed the same chunks
        PendingWriter(lazy, pending_bytes=1 << 30).put(batch)
    killed = PendingWriter(lazy, pending_bytes=1 << 30)
    killed.put(batch[:1])
    (manifest,) = [p for p in (lazy / "pending").glob("*.json") if p.name.startswith(killed._own[0][0])]
    manifest.unlink()  # killed before its manifest
    report = fold(lazy)
    assert (report.objects, report.entries, report.stored, report.incomplete) == (2, 4, 2, 0)
    assert [p.suffix for p in (lazy / "pending").iterdir()] == [".safetensors"]  # the partial one, left alone
    with ragkv.open(lazy, device="cpu", write_back=False) as engine:
        answer = engine.ask(rows[0].text, max_new_tokens=4, context="chunk")
        assert answer.sources[0].chunk_id == rows[0].chunk_id and answer.stats.kv_source == "store"
    monkeypatch.setattr(pending_module, "STALE_S", -1.0)  # now it is old
    assert fold(lazy).incomplete == 1 and not list((lazy / "pending").iterdir())
    with open_snapshot(lazy) as snapshot:
        assert verify(snapshot).ok
    # A reader over its bound drops its oldest objects first, and counts them.
    small = PendingWriter(lazy, pending_bytes=1)
    small.put(batch[:1])
    assert small.report.dropped == 1 and not list((lazy / "pending").iterdir())
