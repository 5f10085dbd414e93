"""Garbage collection: drop KV entries nothing needs, rewrite mostly-dead shards, delete
shard files no generation on disk references, and compact: the catalog's delta (of
COMPACT_ROWS rows or more) into a new base, the vector segments (when there are several, or
tombstones) into one, an IVF one retrained for a large store. Never touches a generation a reader holds."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ragkv.core.errors import StoreCorruptError, StoreNotFoundError
from ragkv.store.writer import StoreWriter, open_writer

REWRITE_BELOW = 0.5  # rewrite a shard once less than this fraction of its bytes is live
COMPACT_ROWS = 5_000  # gc compacts a delta of at least this many rows (a smaller one costs writers nothing)


@dataclass
class GcReport:
    generation: int = 0
    profiles_dropped: int = 0
    entries_removed: int = 0
    shards_rewritten: int = 0
    shards_deleted: int = 0
    bytes_reclaimed: int = 0  # shard bytes deleted from disk
    generations_removed: list[int] = field(default_factory=list)
    generations_kept_for_readers: list[int] = field(default_factory=list)
    catalog_compacted: bool = False
    vectors_compacted: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


def collect_garbage(
    root: Path | str, other_models: bool = False, wait: bool = False, rewrite_below: float = REWRITE_BELOW
) -> GcReport:
    """Publish a generation without dead entries, then reclaim the space they held.

    other_models: also drop every model profile except the one last ingested with.
    """
    report = GcReport()
    with maintaining(root, wait) as writer:
        catalog = writer.catalog
        if other_models:
            keep = catalog.meta().get("last_profile")
            others = [p.profile_id for p in catalog.entries.profiles() if p.profile_id != keep]
            catalog.entries.drop_profiles(others)
            report.profiles_dropped = len(others)
        report.entries_removed, report.shards_rewritten = drop_dead(writer, rewrite_below)
        vectors = writer.vectors
        if vectors is not None and vectors.needs_compaction():
            writer.compact_vectors()
            report.vectors_compacted = True
        if writer.catalog.delta_rows() >= COMPACT_ROWS and not writer.compacted:
            writer.compact()
            report.catalog_compacted = True
        report.generation = writer.publish()
        report.generations_removed, report.generations_kept_for_readers = writer.retired, writer.held_by_readers
        report.shards_deleted, report.bytes_reclaimed = writer.delete_unreferenced_shards()
    return report


@contextmanager
def maintaining(root: Path | str, wait: bool = False) -> Iterator[StoreWriter]:
    """A writer for the existing store at `root` (StoreNotFoundError if there is none): aborted
    on an error, released after the block (publish inside it)."""
    writer = open_writer(root, wait=wait)
    if writer.base_generation is None:
        writer.abort()
        raise StoreNotFoundError(f"no ragkv store at {root}; create one with: ragkv ingest DOCS --store {root}")
    try:
        yield writer
    except BaseException:
        writer.abort()
        raise
    writer.release()


def drop_dead(writer: StoreWriter, rewrite_below: float = REWRITE_BELOW) -> tuple[int, int]:
    """Delete dead entry rows and rewrite mostly-dead shards (their files go after publish,
    in `delete_unreferenced_shards`). Returns (entries dropped, shards rewritten)."""
    dead = writer.catalog.entries.dead_entries()
    writer.catalog.entries.delete_entries(e.kv_key for e in dead)
    return len(dead), rewrite_sparse_shards(writer, rewrite_below)


def rewrite_sparse_shards(writer: StoreWriter, rewrite_below: float) -> int:
    """Copy the live entries of mostly-dead shards into new shards and repoint their rows.
    The old files are deleted once no generation references them."""
    catalog = writer.catalog
    sizes = writer.shard_sizes()
    sparse = [
        shard
        for shard, live in catalog.reports.live_bytes_by_shard().items()
        if shard in sizes and live < rewrite_below * sizes[shard]
    ]
    reader = writer.shard_reader()
    shards = writer.shard_writer(max_bytes=max(sizes.values(), default=1), metadata={"rewritten_by": "gc"})
    sealed = []
    for shard in sparse:
        for entry in catalog.entries.entries_in(shard):
            try:
                sealed += shards.add(entry.kv_key, reader.read_parts(shard, entry.tensor, entry.checksum))
            except StoreCorruptError:
                continue  # left where it is, for `verify --repair` to see and fix
    sealed += shards.flush()
    catalog.entries.move_entries(sealed)
    reader.close()
    return len(sparse)
