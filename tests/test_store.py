"""The store: lossless round trips, checksums, atomic publication, crash and abort safety, locking."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from ragkv.core.errors import (
    InputError,
    StoreCorruptError,
    StoreEmptyError,
    StoreFormatError,
    StoreLockedError,
    StoreNotFoundError,
    StoreWriteError,
)
from ragkv.core.keys import KVKey, Profile
from ragkv.store import Catalog, ShardReader, ShardWriter, StoreWriter, open_snapshot
from ragkv.store.generations import read_current
from tests.conftest import flip_bit_of_entry

ROOT = Path(__file__).resolve().parent.parent
PROFILE = Profile("m", "t", "p", (1, 2), "float32")


def kv(tokens: int, dtype=torch.float32, seed=0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(3, 2, 2, tokens, 8, generator=generator).to(dtype)  # (L, 2, H, T, D)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_shard_round_trip_is_bitwise(tmp_path, dtype):
    writer = ShardWriter(tmp_path, max_bytes=1 << 30, metadata={"layout": "L2HTD"})
    tensors = {f"entry-{i}": kv(5 + i, dtype, seed=i) for i in range(4)}
    sealed = [e for name, t in tensors.items() for e in writer.add(name, t)] + writer.flush()
    assert len(sealed) == 4 and len({e.shard for e in sealed}) == 1
    reader = ShardReader(tmp_path)
    for entry in sealed:
        back = reader.read(entry.shard, entry.name, entry.checksum)
        original = tensors[entry.name]
        assert back.dtype == original.dtype and back.shape == original.shape
        assert back.view(torch.uint8).numpy().tobytes() == original.view(torch.uint8).numpy().tobytes()
        assert entry.num_tokens == original.shape[3]


def test_shards_seal_at_the_size_threshold(tmp_path):
    one = kv(10)
    writer = ShardWriter(tmp_path, max_bytes=one.numel() * 4 * 2, metadata={})
    sealed = []
    for i in range(5):
        sealed += writer.add(f"e{i}", kv(10, seed=i))
    sealed += writer.flush()
    shards = {e.shard for e in sealed}
    assert len(sealed) == 5 and len(shards) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(shards)  # no temporary files left


def test_corruption_is_detected_before_use(tmp_path):
    writer = ShardWriter(tmp_path, max_bytes=1 << 30, metadata={})
    writer.add("a", kv(64))
    (entry,) = writer.flush()
    path = tmp_path / entry.shard
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x10  # one flipped bit in the tensor bytes
    path.write_bytes(bytes(data))
    with pytest.raises(StoreCorruptError, match="checksum"):
        ShardReader(tmp_path).read(entry.shard, "a", entry.checksum)
    path.write_bytes(bytes(data[: len(data) // 2]))  # truncated
    with pytest.raises(StoreCorruptError):
        ShardReader(tmp_path).read(entry.shard, "a", entry.checksum)
    path.unlink()
    with pytest.raises(StoreCorruptError, match="missing"):
        ShardReader(tmp_path).read(entry.shard, "a", entry.checksum)


def _commit_one(root: Path, name="e0", seed=0):
    with StoreWriter(root) as writer:
        writer.ensure_vectors(4).add([len(writer.catalog.reports.all_entries())], np.ones((1, 4), dtype=np.float32) / 2)
        shards = writer.shard_writer(1 << 30, {})
        shards.add(name, kv(4, seed=seed))
        writer.catalog.entries.add_entries("p", shards.flush())


def test_generations_publish_catalog_and_index_together(tmp_path):
    root = tmp_path / "s"
    _commit_one(root)
    _commit_one(root, "e1", seed=1)
    assert read_current(root) == 2
    with open_snapshot(root) as snap:
        assert snap.generation == 2
        assert sorted(e.kv_key for e in snap.catalog.reports.all_entries()) == ["e0", "e1"]
        assert len(snap.vectors) == 2
    _commit_one(root, "e2", seed=2)
    assert generation_files(root) == ["catalog-000003.duckdb", "manifest-000003.json"]  # nobody reads 1 or 2
    assert shared_files(root) == shared_files(root, generations={3})  # bases and segments: only what 3 names


def generation_files(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(("catalog", "vectors", "manifest")))


def shared_files(root: Path, generations: set[int] | None = None) -> set[str]:
    """The bases and segments on disk, or those the manifests of `generations` name."""
    if generations is not None:
        named = set()
        for g in generations:
            manifest = json.loads((root / f"manifest-{g:06d}.json").read_text())
            named |= {manifest["base"]} | {
                f"segments/{f}" for s in manifest["segments"] for f in (s["name"], s["terms"])
            }
        return named
    return {p.name for p in root.glob("base-*")} | {f"segments/{p.name}" for p in (root / "segments").iterdir()}


def test_a_generation_a_reader_holds_is_kept_until_it_lets_go(tmp_path):
    root = tmp_path / "s"
    _commit_one(root)
    reader = open_snapshot(root)
    _commit_one(root, "e1", seed=1)
    _commit_one(root, "e2", seed=2)
    assert generation_files(root) == [
        "catalog-000001.duckdb",
        "catalog-000003.duckdb",
        "manifest-000001.json",
        "manifest-000003.json",
    ]
    assert shared_files(root) == shared_files(root, generations={1, 3})
    assert [e.kv_key for e in reader.catalog.reports.all_entries()] == ["e0"]  # still answers from generation 1
    assert len(reader.vectors) == 1
    reader.close()
    _commit_one(root, "e3", seed=3)
    assert generation_files(root) == ["catalog-000004.duckdb", "manifest-000004.json"]
    assert shared_files(root) == shared_files(root, generations={4})


def test_readers_keep_their_generation_while_a_writer_works(tmp_path):
    root = tmp_path / "s"
    _commit_one(root)
    writer = StoreWriter(root)
    shards = writer.shard_writer(1 << 30, {})
    shards.add("new", kv(4, seed=9))
    writer.catalog.entries.add_entries("p", shards.flush())
    with open_snapshot(root) as snap:  # DuckDB would refuse this if the writer held the same file
        assert snap.generation == 1 and len(snap.catalog.reports.all_entries()) == 1
    writer.commit()
    with open_snapshot(root) as snap:
        assert snap.generation == 2 and len(snap.catalog.reports.all_entries()) == 2


def test_abort_leaves_the_published_store_as_it_was_and_keeps_sealed_work(tmp_path):
    root = tmp_path / "s"
    _commit_one(root)
    published = generation_files(root) + [(root / "CURRENT").read_text()]
    key = KVKey.for_chunk(PROFILE, [1, 2, 3]).to_string()
    with pytest.raises(RuntimeError):
        with StoreWriter(root) as writer:
            shards = writer.shard_writer(1, {})
            writer.catalog.entries.add_entries("p", shards.add(key, kv(4, seed=3)))
            raise RuntimeError("boom")
    assert generation_files(root) + [(root / "CURRENT").read_text()] == published
    with open_snapshot(root) as snap:
        assert [e.kv_key for e in snap.catalog.reports.all_entries()] == ["e0"]
    with StoreWriter(root) as writer:  # the sealed entry is verified and adopted, not lost
        assert [e.name for e in writer.adopt_orphans()] == [key]
        assert writer.catalog.entries.entry(key) is not None
    fresh = tmp_path / "new"
    with pytest.raises(RuntimeError):
        with StoreWriter(fresh):
            raise RuntimeError("boom")
    assert not fresh.exists()


def test_adoption_skips_entries_that_fail_their_checksum(tmp_path):
    root = tmp_path / "s"
    _commit_one(root)
    keys = [KVKey.for_chunk(PROFILE, [i]).to_string() for i in range(2)]
    writer = StoreWriter(root)
    shards = writer.shard_writer(1 << 30, {})
    for i, key in enumerate(keys):
        shards.add(key, kv(16, seed=i))
    (entry, _) = shards.flush()
    writer.abort()
    flip_bit_of_entry(root / "shards" / entry.shard, keys[0])
    with StoreWriter(root) as writer:
        assert [e.name for e in writer.adopt_orphans()] == [keys[1]]


def test_a_failed_seal_leaves_no_file_and_no_row(tmp_path, monkeypatch):
    root = tmp_path / "s"
    _commit_one(root)

    def failing_rename(*args):
        raise OSError("disk full")

    with pytest.raises(StoreWriteError, match="disk full"):
        with StoreWriter(root) as writer:
            shards = writer.shard_writer(1 << 30, {})
            shards.add("x", kv(4, seed=3))
            monkeypatch.setattr(os, "rename", failing_rename)
            writer.catalog.entries.add_entries("p", shards.flush())
    monkeypatch.undo()
    with open_snapshot(root) as snap:
        assert [e.kv_key for e in snap.catalog.reports.all_entries()] == ["e0"]
    assert len(list((root / "shards").iterdir())) == 1


CRASH_BEFORE_SEAL = textwrap.dedent("""
    import os, sys, torch
    sys.path.insert(0, {root!r})
    from ragkv.store import StoreWriter
    writer = StoreWriter({store!r})
    shards = writer.shard_writer(1 << 30, {{}})
    shards.add("unsealed", torch.ones(1, 2, 1, 3, 4))
    {after}
    os._exit(1)  # killed: no flush, no commit, no cleanup
""")


@pytest.mark.parametrize("after", ["", "writer.catalog.entries.add_entries('p', shards.flush())"])
def test_a_crash_before_commit_leaves_no_row_pointing_at_nothing(tmp_path, after):
    root = tmp_path / "s"
    _commit_one(root)
    script = CRASH_BEFORE_SEAL.format(root=str(ROOT), store=str(root), after=after)
    assert subprocess.run([sys.executable, "-c", script]).returncode == 1
    with open_snapshot(root) as snap:
        assert snap.generation == 1
        entries = snap.catalog.reports.all_entries()
        assert [e.kv_key for e in entries] == ["e0"]
        for e in entries:  # every row's shard exists and verifies
            snap.shards.read(e.shard, e.tensor, e.checksum)
    _commit_one(root, "e1", seed=1)  # the next writer recovers (the crashed one's lock died with it)
    assert read_current(root) == 2


def test_second_writer_fails_fast_naming_the_holder(tmp_path):
    root = tmp_path / "s"
    first = StoreWriter(root)
    with pytest.raises(StoreLockedError, match=f"pid {os.getpid()}"):
        StoreWriter(root)
    first.abort()
    StoreWriter(root).abort()


def test_a_directory_that_is_not_a_store_is_never_written(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(InputError, match="is not a ragkv store"):
        StoreWriter(tmp_path)
    with pytest.raises(InputError, match="is not a ragkv store"):
        StoreWriter(tmp_path / "notes.txt")
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_missing_and_empty_stores_say_so(tmp_path):
    with pytest.raises(StoreNotFoundError, match="ragkv ingest"):
        open_snapshot(tmp_path / "nothing")
    with StoreWriter(tmp_path / "empty") as writer:
        writer.ensure_vectors(4)
    with pytest.raises(StoreEmptyError, match="holds no documents"):
        open_snapshot(tmp_path / "empty")


def test_a_catalog_from_a_newer_ragkv_is_refused(tmp_path):
    path = tmp_path / "c.duckdb"
    catalog = Catalog(path, read_only=False)
    migrations = json.loads(catalog.meta()["migrations"]) + ["9999_from_the_future"]
    catalog.set_meta({"migrations": json.dumps(migrations)})
    catalog.close()
    with pytest.raises(StoreFormatError, match="newer"):
        Catalog(path, read_only=True)


def test_a_compacted_base_is_sorted_by_key_in_small_row_groups(tmp_path):
    """A point lookup reads the row groups its keys' zone maps do not rule out: the base a
    compaction writes keeps each table in key order, in groups of BASE_ROW_GROUP rows."""
    from ragkv.store.catalog.overlay import BASE_ROW_GROUP

    catalog = Catalog(tmp_path / "plain.duckdb", read_only=False)
    rows = 3 * BASE_ROW_GROUP + 5
    catalog.con.execute(  # written in descending key order
        f"INSERT INTO chunks BY NAME SELECT {rows} - range AS chunk_id, 'd' AS doc_id, "
        f"range::INTEGER AS chunk_index, 'text' AS text FROM range({rows})"
    )
    catalog.compact_into(tmp_path / "base.duckdb")
    catalog.close()
    with Catalog(tmp_path / "base.duckdb", read_only=True) as base:
        stored = base.con.execute("SELECT chunk_id FROM chunks").fetchnumpy()["chunk_id"]  # in storage order
        groups = base.value("SELECT count(DISTINCT row_group_id) FROM pragma_storage_info('chunks')")
    assert list(stored) == list(range(1, rows + 1))
    assert groups == 4


def test_context_rows_point_lookups_return_what_one_join_over_the_tables_returns(
    tiny_llama, corpus, tmp_path, monkeypatch
):
    """Over a delta (a document removed, one added without KV): each asked chunk once per time
    asked, in the order asked, its source, link and entry as the join gives them; an unknown
    id is left out."""
    import shutil

    import ragkv.store.catalog.entries as entries_module
    from tests.conftest import build_store

    docs, store = tmp_path / "docs", tmp_path / "store"
    shutil.copytree(corpus, docs)
    build_store(docs, store, str(tiny_llama))
    (docs / "keys.md").unlink()
    (docs / "new.md").write_text("# Badges\n\nVisitors collect a badge at reception and return it when leaving.")
    build_store(docs, store, str(tiny_llama), prune=True, precompute=0)
    with open_snapshot(store) as snapshot:
        catalog = snapshot.catalog
        assert catalog.delta  # the rows come from the base and the delta's additions and deletions
        profile_id = catalog.meta()["last_profile"]
        ids = sorted(catalog.documents.chunk_ids(), reverse=True)
        asked = [*ids, 10**9, ids[0]]
        assert len(asked) <= entries_module.POINT_LOOKUPS  # a question's context
        rows = catalog.entries.context_rows(profile_id, asked)  # point lookups
        assert rows == catalog.entries._joined_rows(profile_id, asked)  # what context_rows was: the reference
        monkeypatch.setattr(entries_module, "POINT_LOOKUPS", 2)  # many ids (a rerank's): one join
        assert catalog.entries.context_rows(profile_id, asked) == rows
    assert [r.chunk_id for r in rows] == [*ids, ids[0]]
    assert any(r.entry is None and r.doc_id == "new.md" for r in rows)  # no KV: computed on its first question
    assert all(r.entry is not None for r in rows if r.doc_id != "new.md")
