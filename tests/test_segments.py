"""Generations that cost what changed: the catalog as a delta over a shared base, the vectors as
immutable segments (flat and IVF) with tombstones, compaction, and the one-time migration of a
store written before segments (format 1)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import numpy as np
import pytest

from ragkv.core.errors import StoreCorruptError
from ragkv.store import StoreWriter, collect_garbage, open_snapshot, verify
from ragkv.store.catalog import ChunkRow, DocumentRow
from ragkv.store.generations import manifest_path, read_current
from ragkv.store.index import build, segments, vectors
from ragkv.store.stats import store_stats
from tests.conftest import ROOT

DIM = 16
FORMAT1 = Path(__file__).parent / "data" / "format1-store.tar.gz"


def unit(rng, n: int, dim: int = DIM) -> np.ndarray:
    v = rng.standard_normal((n, dim)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def add_docs(writer: StoreWriter, names: list[str], rng, per_doc: int = 10) -> dict[int, np.ndarray]:
    catalog = writer.catalog
    first = catalog.documents.next_chunk_id()
    chunks = [
        ChunkRow(first + i * per_doc + j, d, j, f"{d} part {j}") for i, d in enumerate(names) for j in range(per_doc)
    ]
    catalog.documents.add_documents(
        [DocumentRow(d, d, f"h-{d}-{first}", "t", per_doc) for d in names], [{}] * len(names), chunks
    )
    vectors = unit(rng, len(chunks))
    writer.ensure_vectors(DIM).add([c.chunk_id for c in chunks], vectors)
    return {c.chunk_id: v for c, v in zip(chunks, vectors, strict=False)}


def near(rng, vectors: np.ndarray, n: int) -> np.ndarray:
    """Queries near stored vectors (not equal to any), as a question is near its passages."""
    picks = vectors[rng.choice(len(vectors), n, replace=False)]
    queries = picks + 0.7 * unit(rng, n, vectors.shape[1])
    return queries / np.linalg.norm(queries, axis=1, keepdims=True)


def recall(snapshot, stored: dict[int, np.ndarray], queries: np.ndarray) -> float:
    ids = np.array(list(stored))
    matrix = np.stack(list(stored.values()))
    truth = ids[np.argsort(-(queries @ matrix.T), axis=1)[:, :10]]
    found = np.array([[h.chunk_id for h in snapshot.vectors.search(q, 10)] for q in queries])
    return build.recall_at(found, truth)


@pytest.fixture
def small_ivf(monkeypatch):
    monkeypatch.setattr(build, "IVF_MIN", 2000)


def test_a_large_store_searches_an_ivf_segment_and_a_change_writes_only_itself(tmp_path, small_ivf):
    rng = np.random.default_rng(0)
    root = tmp_path / "s"
    with StoreWriter(root) as writer:
        stored = add_docs(writer, [f"d{i:04d}" for i in range(600)], rng)  # 6000 chunks
    first_gc = collect_garbage(root)  # as the nightly job runs it: the catalog becomes a base
    assert first_gc.catalog_compacted and not first_gc.vectors_compacted
    with open_snapshot(root) as snap:
        index = store_stats(snap)["index"]
        assert index["type"] == "ivf-pq" and index["segments"] == 1 and 1 < index["nprobe"] < index["nlist"]
        assert index["tuned_recall_at_10"] >= build.RECALL_TARGET
        # in memory: the codes and ids, not the float32 vectors (memory-mapped for the re-score)
        assert index["ram_bytes"] < 6000 * 4 * 64 // 2 and index["rescore"] >= segments.RESCORE
        assert recall(snap, stored, near(rng, np.stack(list(stored.values())), 100)) >= 0.93  # fresh queries
    ivf_file = next((root / "segments").glob("*.faiss"))
    terms_file = next((root / "segments").glob("terms-*"))
    vectors_file = next((root / "segments").glob("vec-*.npy"))
    ivf_bytes, terms_bytes = ivf_file.read_bytes(), terms_file.read_bytes()
    assert json.loads(manifest_path(root, read_current(root)).read_bytes())["format"] == 3  # older readers refuse it

    # One document changes: its vectors become tombstones, its new ones a small flat segment.
    with StoreWriter(root) as writer:
        old_ids = writer.catalog.documents.delete_documents(["d0007"])
        assert writer.vectors.remove(old_ids) == 10
        new = add_docs(writer, ["d0007"], rng)
    assert ivf_file.read_bytes() == ivf_bytes and vectors_file.exists()  # the big segment was not rewritten
    assert terms_file.read_bytes() == terms_bytes  # nor its lexical file
    assert min(new) > max(stored)  # chunk ids are never reused: a tombstone names one chunk forever
    with open_snapshot(root) as snap:
        assert len(snap.vectors.segments) == 2 and len(snap.vectors.gone) == 10
        for cid in old_ids:  # a removed vector is never returned, even searched for exactly
            assert cid not in {h.chunk_id for h in snap.vectors.search(stored[cid], 10)}
        for cid, vector in new.items():
            assert snap.vectors.search(vector, 1)[0].chunk_id == cid
        assert {h.chunk_id for h in snap.vectors.search_terms(["d0007"], 50)} == set(new)  # words: the new ones only
        assert len(snap.vectors) == 6000 and verify(snap).ok
        catalog = store_stats(snap)["catalog"]
        assert catalog["base_rows"] >= 6000 and 0 < catalog["delta_rows"] < 100  # the change, not the store
    for cid in old_ids:
        stored.pop(cid)
    stored.update(new)

    # gc compacts: one segment again, no tombstones, the same answers.
    report = collect_garbage(root)
    assert report.vectors_compacted
    with open_snapshot(root) as snap:
        assert (
            len(snap.vectors.segments) == 1 and not len(snap.vectors.gone) and snap.vectors.segments[0].kind == "ivfpq"
        )
        assert recall(snap, stored, near(rng, np.stack(list(stored.values())), 100)) >= 0.93
        assert verify(snap).ok
    assert not ivf_file.exists() and not terms_file.exists() and not vectors_file.exists()  # nothing names them


def test_an_ivf_flat_segment_of_an_earlier_ragkv_is_searched_then_compacted_into_ivf_pq(tmp_path, small_ivf):
    """A format-2 store whose large segment is IVF-flat (as ragkv 0.1 wrote it) is read as it is;
    the next compaction rewrites it as IVF-PQ with its vectors file, and the manifest becomes
    format 3. A vectors file that does not fit its segment is a one-line error naming it."""
    import faiss

    rng = np.random.default_rng(3)
    root = tmp_path / "s"
    with StoreWriter(root) as writer:
        stored = add_docs(writer, [f"d{i:04d}" for i in range(300)], rng)  # 3000 chunks: one IVF segment
    path = manifest_path(root, read_current(root))
    manifest = json.loads(path.read_bytes())
    (segment,) = manifest["segments"]
    ids = np.array(sorted(stored), dtype=np.int64)
    quantizer = faiss.IndexFlatIP(DIM)
    old = faiss.IndexIVFFlat(quantizer, DIM, segment["nlist"], faiss.METRIC_INNER_PRODUCT)
    old.train(np.stack([stored[i] for i in ids]))
    old.add_with_ids(np.stack([stored[i] for i in ids]), ids)
    faiss.write_index(old, str(root / "segments" / "seg-old.faiss"))
    (root / "segments" / segment["vectors"]).unlink()
    segment.update(
        name="seg-old.faiss",
        kind="ivf",
        nbytes=(root / "segments" / "seg-old.faiss").stat().st_size,
        vectors="",
        vectors_nbytes=0,
        pq_bytes=0,
        rescore=0,
        nprobe=segment["nlist"],
    )
    path.write_text(json.dumps({**manifest, "format": 2}))
    with open_snapshot(root) as snap:
        assert snap.vectors.segments[0].kind == "ivf" and store_stats(snap)["index"]["type"] == "ivf-flat"
        assert recall(snap, stored, near(rng, np.stack(list(stored.values())), 50)) == 1.0  # every list: exact
        assert verify(snap).ok

    with StoreWriter(root) as writer:  # a change, then gc: the compaction rewrites it
        assert writer.vectors.remove(writer.catalog.documents.delete_documents(["d0001"])) == 10
    for chunk_id in range(10, 20):
        stored.pop(chunk_id, None)
    assert collect_garbage(root).vectors_compacted
    path = manifest_path(root, read_current(root))
    with open_snapshot(root) as snap:
        (info,) = snap.vectors.segments
        assert info.kind == "ivfpq" and json.loads(path.read_bytes())["format"] == 3
        assert recall(snap, stored, near(rng, np.stack(list(stored.values())), 100)) >= 0.93
        assert verify(snap).ok
    vectors_file = root / "segments" / info.vectors
    vectors_file.write_bytes(vectors_file.read_bytes()[:-4])
    with pytest.raises(StoreCorruptError, match=f"vectors file segments/{info.vectors} is damaged"):
        open_snapshot(root)


def test_small_flat_segments_merge_and_search_stays_exact(tmp_path):
    rng = np.random.default_rng(1)
    root = tmp_path / "s"
    stored = {}
    for i in range(vectors.MAX_FLAT + 2):
        with StoreWriter(root) as writer:
            stored.update(add_docs(writer, [f"d{i}"], rng))
    with open_snapshot(root) as snap:
        assert all(s.kind == "flat" for s in snap.vectors.segments) and len(snap.vectors.segments) <= vectors.MAX_FLAT
        assert recall(snap, stored, near(rng, np.stack(list(stored.values())), 20)) == 1.0  # flat is exact
        files = {p.name for p in (root / "segments").iterdir()}
        assert files == {f for s in snap.vectors.segments for f in s.files()}  # merged-away segments are deleted


def test_a_missing_or_damaged_segment_is_one_line_naming_the_repair(tmp_path):
    rng = np.random.default_rng(2)
    root = tmp_path / "s"
    with StoreWriter(root) as writer:
        add_docs(writer, ["a", "b"], rng)
    segment = next((root / "segments").glob("*.faiss"))
    segment.write_bytes(segment.read_bytes()[:-7])
    with pytest.raises(StoreCorruptError, match=r"truncated.*ragkv verify --repair") as error:
        open_snapshot(root)
    assert "\n" not in str(error.value)
    segment.unlink()
    with pytest.raises(StoreCorruptError, match=r"missing.*ragkv verify --repair"):
        open_snapshot(root)
    with open_snapshot(root, require_documents=False, lenient=True) as snap:  # what verify sees
        assert [p.kind for p in verify(snap).problems] == ["vectors-unreadable"]


def test_a_store_of_format_1_is_read_as_it_is_and_migrated_once(tmp_path, caplog):
    """The archive is a store written by ragkv before segments (commit 102d0ec): two generations
    through its `StoreWriter`, 8 documents, 24 chunks with KV entries in two shards, 8-dim vectors."""
    with tarfile.open(FORMAT1) as archive:
        archive.extractall(tmp_path, filter="data")
    root = tmp_path / "format1"
    with open_snapshot(root) as snap:  # read without migrating
        assert snap.generation == 2 and snap.catalog.reports.counts()["chunks"] == 24 and verify(snap).ok
        ids, vectors = snap.vectors.live_vectors()
        before = [[h.chunk_id for h in snap.vectors.search(v, 5)] for v in vectors]
        rows = snap.catalog.entries.context_rows("p-format1", ids.tolist())
    assert sorted(p.name for p in root.iterdir() if p.is_file()) == [
        "CURRENT",
        "catalog-000002.duckdb",
        "vectors-000002.faiss",
    ]
    with caplog.at_level(logging.WARNING, logger="ragkv"):
        with StoreWriter(root) as writer:
            assert writer.migrated_format
    assert sum("migrating from format 1" in r.message for r in caplog.records) == 1
    assert not writer.unchanged and writer.generation == 3
    names = sorted(p.name for p in root.iterdir() if p.is_file() and p.name != "LOCK")
    assert (
        names[0] == "CURRENT"
        and names[1].startswith("base-000003-")
        and names[2:] == ["catalog-000003.duckdb", "manifest-000003.json"]
    )  # generation 2's files retired
    with open_snapshot(root) as snap:
        assert verify(snap).ok and snap.catalog.entries.context_rows("p-format1", ids.tolist()) == rows
        assert [[h.chunk_id for h in snap.vectors.search(v, 5)] for v in vectors] == before
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ragkv"):
        with StoreWriter(root) as writer:
            pass
    assert writer.unchanged and not caplog.records  # once: the next writer finds format 2


KILL_MID_COMPACTION = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r})
    from ragkv.store.writer import StoreWriter
    from tests.faults import kill_mid_compaction

    kill_mid_compaction()
    with StoreWriter({store!r}) as writer:
        writer.vectors.remove(writer.catalog.documents.delete_documents(["d0"]))
        writer.compact()
    print("not killed")
""")


def test_a_kill_during_compaction_leaves_the_published_generation(tmp_path):
    rng = np.random.default_rng(3)
    root = tmp_path / "s"
    with StoreWriter(root) as writer:
        add_docs(writer, [f"d{i}" for i in range(5)], rng)
    with open_snapshot(root) as snap:
        generation, counts, bases = snap.generation, snap.catalog.reports.counts(), sorted(root.glob("base-*"))
    result = subprocess.run(
        [sys.executable, "-c", KILL_MID_COMPACTION.format(root=str(ROOT), store=str(root))],
        capture_output=True,
        text=True,
    )
    assert result.returncode == -9 and "not killed" not in result.stdout, result.stderr
    assert len(list(root.glob("base-*"))) > len(bases)  # the half-written base is there ...
    with open_snapshot(root) as snap:  # ... and nothing reads it
        assert snap.generation == generation and snap.catalog.reports.counts() == counts and verify(snap).ok
    with StoreWriter(root) as writer:  # the next writer removes it and goes on
        writer.vectors.remove(writer.catalog.documents.delete_documents(["d0"]))
    assert sorted(root.glob("base-*")) == bases
    with open_snapshot(root) as snap:
        assert snap.catalog.reports.counts()["documents"] == 4 and verify(snap).ok


def test_a_delta_reads_like_the_whole_catalog(tmp_path):
    """Every kind of write through the delta (insert, replace, delete of base and delta rows)
    reads back as the same writes on a plain catalog."""
    rng = np.random.default_rng(4)
    root = tmp_path / "s"
    with StoreWriter(root) as writer:
        add_docs(writer, [f"d{i}" for i in range(3)], rng)
        writer.compact()  # the three documents now live in a base
    with StoreWriter(root) as writer:
        catalog = writer.catalog
        writer.vectors.remove(catalog.documents.delete_documents(["d1"]))  # base rows: tombstones
        add_docs(writer, ["d3"], rng)
        writer.vectors.remove(catalog.documents.delete_documents(["d3"]))  # delta rows: gone from the delta
        add_docs(writer, ["d1"], rng)  # a key deleted from the base, added again
        catalog.set_meta({"embedder": "x"})
        catalog.set_meta({"embedder": "y"})  # replaced twice
    with open_snapshot(root) as snap:
        docs = snap.catalog.documents.all()
        assert sorted(docs) == ["d0", "d1", "d2"] and snap.catalog.meta()["embedder"] == "y"
        assert len(snap.catalog.documents.chunks_of(["d1"])) == 10 and len(snap.vectors) == 30 and verify(snap).ok
    plain = tmp_path / "plain.duckdb"
    writer = StoreWriter(root)
    writer.catalog.compact_into(plain)  # what a compaction would write
    writer.abort()
    from ragkv.store.catalog import Catalog

    with Catalog(plain, read_only=True) as whole, open_snapshot(root) as snap:
        for query in (
            "SELECT doc_id, source, content_hash, num_chunks, metadata FROM documents ORDER BY ALL",
            "SELECT * FROM chunks ORDER BY ALL",
            "SELECT * FROM meta ORDER BY ALL",
        ):
            assert whole.con.execute(query).fetchall() == snap.catalog.con.execute(query).fetchall()


SWITCHES = 1000  # the unfixed catalog hung after 141 to 373 switches in 7 runs of 8 (~35 ms a switch)
SWITCHING_READER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r})
    from pathlib import Path
    from ragkv.store.catalog import Catalog
    from ragkv.store.generations import catalog_path

    root, generations = Path({store!r}), {generations!r}
    old = Catalog(catalog_path(root, generations[0]), read_only=True)
    for i in range({switches}):
        # As a reader switching generations: the new catalog opens before the old one closes.
        new = Catalog(catalog_path(root, generations[(i + 1) % 2]), read_only=True)
        if i % 100 == 0:
            assert new.reports.counts()["documents"] == 2 + (i + 1) % 2
        old.close()
        old = new
    old.close()
    print("switched", {switches}, flush=True)
""")


def test_a_reader_switches_between_generations_over_one_base_without_hanging(tmp_path):
    """A long-lived reader opens each new generation before it closes the old, and every
    generation's catalog is a delta over the same base: in one process one file is attached
    again and again from new DuckDB instances while an old one still has it. DuckDB's `ATTACH
    IF NOT EXISTS` could spin forever there (a reader stopped answering mid re-index)."""
    rng = np.random.default_rng(5)
    root = tmp_path / "s"
    with StoreWriter(root) as writer:
        add_docs(writer, ["d0", "d1"], rng)
        writer.compact()  # both generations below are deltas over this base
    with open_snapshot(root) as first:  # held: the next publish keeps this generation on disk
        with StoreWriter(root) as writer:
            add_docs(writer, ["d2"], rng)
        with open_snapshot(root) as second:
            generations = [first.generation, second.generation]
            assert first.catalog.base_name() == second.catalog.base_name()
    script = SWITCHING_READER.format(root=str(ROOT), store=str(root), generations=generations, switches=SWITCHES)
    # A subprocess, so that a hang (in C, where no signal reaches Python) fails this test; the
    # timeout is a hang guard only.
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and result.stdout.split() == ["switched", str(SWITCHES)], result.stderr[-2000:]
