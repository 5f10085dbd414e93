"""Writing a store: `open_writer` gives a `StoreWriter` for a folder or an S3 store, which builds
the next generation over the published one (taking the store's lock) and publishes it
atomically. Where its bytes go: ragkv.store.transport; reading a store: ragkv.store.snapshot."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from pathlib import Path

import duckdb

from ragkv.core.errors import InputError, StoreCorruptError, StoreFormatError, StoreWriteError
from ragkv.core.keys import KVKey
from ragkv.store.catalog import Catalog
from ragkv.store.catalog.overlay import Overlay
from ragkv.store.format1 import migrate as migrate_format1
from ragkv.store.generations import (
    SEGMENT_DIR,
    WriteLock,
    base_name,
    catalog_path,
    check_base,
    generations_on_disk,
    is_legacy,
    publish,
    read_current,
    read_manifest,
    remove_retired,
    remove_unpublished,
    remove_unshared,
    write_manifest,
)
from ragkv.store.index.segments import Segment, SegmentInfo, load_segment
from ragkv.store.index.vectors import VectorIndex
from ragkv.store.kv.shards import (
    SealedEntry,
    ShardReader,
    ShardWriter,
    fsync_dir,
    remove_temporary,
    sealed_entries,
    shard_files,
)
from ragkv.store.objects import is_remote, write_error
from ragkv.store.snapshot import SHARD_DIR, is_foreign
from ragkv.store.transport import LocalTransport, S3Transport, Transport

log = logging.getLogger("ragkv")
_WRITE_ERRORS = (OSError, duckdb.IOException, duckdb.FatalException)  # FatalException: a failed checkpoint


COMPACT_MIN_ROWS = 20_000  # a delta this small is never compacted by a writer (gc compacts any)
COMPACT_SHARE = 0.10  # ... and a larger one once it holds this share of the base's rows


class StoreWriter:
    """Builds the next generation of a store; `commit` publishes it, `abort` leaves no trace.

    Holds the store's write lock from construction to commit/abort. The catalog is a copy of
    the current generation's delta (see store.catalog.overlay), the vector index the current
    segments plus what this writer adds (see ragkv.store.index.vectors): what it copies and writes grows
    with the change, not the store. Shards sealed before an abort (or a kill) stay: no
    published catalog references them, the next writer adopts what it can use
    (`adopt_orphans`) and gc removes the rest. File-system failures (read-only, disk full)
    surface as StoreWriteError.
    """

    def __init__(
        self, root: Path | str, wait: bool = False, rebuild_vectors: bool = False, transport: Transport | None = None
    ):
        self.root = Path(root)
        # Where what leaves the folder goes; see store.transport. An S3 store's is given its mirror as `root`.
        self.transport: Transport = transport or LocalTransport(self.root)
        self._partial: Path | None = None
        self._created_root = not self.root.exists()
        if not self._created_root and is_foreign(self.root):
            raise InputError(f"{self.root} exists and is not a ragkv store; pass an empty or new directory as --store")
        if (self.root / SHARD_DIR).exists() and not (self.root / SHARD_DIR).is_dir():
            raise StoreFormatError(
                f"store {self.root}: {SHARD_DIR} is not a folder (the store keeps its KV shards "
                f"there); move it aside, then run: ragkv verify --repair --store {self.root}"
            )
        self._lock = None
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._lock = WriteLock(self.root, wait)
            self.base_generation = read_current(self.root)
            check_base(self.root, self.base_generation)  # before anything is removed
            self.generation = (self.base_generation or 0) + 1
            remove_unpublished(self.root, self.base_generation)
            remove_temporary(self.shard_dir)
            self._partial = catalog_path(self.root, self.generation).with_suffix(".duckdb.partial")
            self.vectors: VectorIndex | None = None  # rebuild_vectors: repair makes it hold the catalog's chunks
            self.compacted = False  # this writer wrote a new base (see `compact`)
            self.migrated_format = False  # this writer brought a format-1 store forward
            self._open_vectors(*self._open_catalog(), rebuild_vectors)
            # What the published generation holds; publishing the same again would be a no-op.
            self._base_rows = (
                self.catalog.fingerprint()
                if self.base_generation is not None and not (self.catalog.migrated or self.migrated_format)
                else None
            )
            if self.catalog.needs_compaction:  # its base is of an older schema: migrate by compacting
                log.info("store %s: migrating the catalog's schema (writes a new base)", self.root)
                self.compact()
        except BaseException as exc:
            if self._partial is not None and self._lock:  # our own copy: nobody else reads it
                self._partial.unlink(missing_ok=True)
            if self._lock:
                self._lock.release()
            if isinstance(exc, _WRITE_ERRORS):
                raise write_error(self.root, exc) from exc
            raise
        self._closed = False
        self._published = False
        self.unchanged = False  # publish found nothing new: the current generation stays
        self.retired: list[int] = []  # generations removed at publish
        self.held_by_readers: list[int] = []  # retired generations kept because a reader holds them

    def _open_vectors(self, infos: list[SegmentInfo], dim: int, rebuild: bool) -> None:
        """The base generation's vector index (none in an empty store). `rebuild` (repair): only
        the segments that load, kept loaded; repair re-embeds the rest's chunks."""
        loaded = dict(self._legacy_loaded)
        if rebuild:
            loaded |= {
                info.name: segment
                for info in infos
                if info.name not in loaded and (segment := self._load(info)) is not None
            }
        healthy = [info for info in infos if info.name in loaded] if rebuild else infos
        if dim and healthy:
            self.vectors = VectorIndex(
                dim, self.root / SEGMENT_DIR, healthy, self.catalog.tombstones.ids(), loaded=loaded
            )
            if len(healthy) < len(infos):
                self.vectors.mark_changed()

    def _load(self, info: SegmentInfo) -> Segment | None:
        """A segment of the published index, loaded; None when it does not load (repair keeps
        the ones that do, and re-embeds only the chunks of the others)."""
        try:
            return load_segment(self.root / SEGMENT_DIR, info)
        except StoreCorruptError as exc:
            log.warning("store %s: dropping a damaged index segment: %s", self.root, exc)
            return None

    def _open_catalog(self) -> tuple[list[SegmentInfo], int]:
        """Open this writer's delta: a copy of the published one, a new one over a format-1
        catalog (migrating it), or over a new empty base. Returns the segments and dimension."""
        self._legacy_loaded: dict[str, Segment] = {}
        if self.base_generation is None:
            base = base_name(self.generation)
            Catalog(self.root / base, read_only=False).close()
            self._new_delta(base)
            return [], 0
        if is_legacy(self.root, self.base_generation):
            return self._migrate_format()
        manifest = read_manifest(self.root, self.base_generation)
        shutil.copyfile(catalog_path(self.root, self.base_generation), self._partial)
        self.catalog = self._open_partial()
        return [SegmentInfo.from_dict(s) for s in manifest["segments"]], int(manifest.get("dim", 0))

    def _open_partial(self) -> Catalog:
        try:
            return Catalog(self._partial, read_only=False)
        except StoreFormatError as exc:  # name the published file, not our copy of it
            raise StoreFormatError(
                str(exc).replace(str(self._partial), str(catalog_path(self.root, self.base_generation or 0)))
            ) from None

    def _new_delta(self, base: str) -> None:
        con = duckdb.connect(str(self._partial))
        try:
            con.execute(f"ATTACH '{self.root / base}' AS base (READ_ONLY)")
            Overlay.create_delta(con, base)
        finally:
            con.close()
        self.catalog = self._open_partial()

    def _migrate_format(self) -> tuple[list[SegmentInfo], int]:
        """Bring a format-1 generation forward, once (store.format1), and open a delta over it."""
        migrated = migrate_format1(self.root, self.base_generation or 0, self.generation)
        self._new_delta(migrated.base)
        self.migrated_format = True
        self._legacy_loaded = migrated.loaded
        return migrated.segments, migrated.dim

    def compact(self) -> None:
        """Write the catalog as it reads now into a new base and start an empty delta over it
        (the vector tombstones carried over). Costs what the store holds: writers do it only
        once the delta outgrows its share (COMPACT_SHARE), `gc` whenever there is a delta."""
        base = base_name(self.generation)
        gone = self.catalog.tombstones.ids()
        self.catalog.compact_into(self.root / base)
        self.catalog.close()
        self._partial.unlink()
        self._new_delta(base)
        self.catalog.tombstones.replace(gone)
        self.compacted = True

    @property
    def shard_dir(self) -> Path:
        return self.root / SHARD_DIR

    @property
    def location(self) -> str:
        """What the user named: the folder, or the s3:// URI."""
        return self.transport.location

    def shard_writer(self, max_bytes: int, metadata: dict[str, str]) -> ShardWriter:
        return self.transport.shard_writer(max_bytes, metadata)

    def shard_sizes(self) -> dict[str, int]:
        """Sealed shard files of the store and their sizes."""
        return self.transport.shard_sizes()

    def shard_reader(self) -> ShardReader:
        return self.transport.shard_reader()

    def ensure_vectors(self, dim: int) -> VectorIndex:
        if self.vectors is None:
            self.vectors = VectorIndex(dim, self.root / SEGMENT_DIR)
        elif self.vectors.dim != dim:
            raise StoreFormatError(f"store {self.root} holds {self.vectors.dim}-dim vectors, the embedder gives {dim}")
        return self.vectors

    def fresh_vectors(self, dim: int) -> VectorIndex:
        """An empty index that replaces the published one on publish: the embedding space changed."""
        self.vectors = VectorIndex(dim, self.root / SEGMENT_DIR)
        self.vectors.mark_changed()
        return self.vectors

    def adopt_orphans(self) -> list[SealedEntry]:
        """Commit rows for verified entries of sealed shards the catalog does not reference:
        the work of a writer killed after sealing them. KV is content-addressed, so such an
        entry is valid for its key whatever happened to the writer. Returns the adopted entries."""
        referenced = self.catalog.reports.shards()
        adopted = []
        for shard in sorted(set(shard_files(self.shard_dir)) - referenced):
            entries = [e for e in sealed_entries(self.shard_dir, shard) if _is_key(e.name)]
            for profile_id in {KVKey.from_string(e.name).profile_id for e in entries}:
                mine = [e for e in entries if KVKey.from_string(e.name).profile_id == profile_id]
                prefix = {e.name for e in mine if KVKey.from_string(e.name).is_prefix}
                self.catalog.entries.add_entries(profile_id, mine, prefix)
            adopted += entries
        self.transport.adopted({e.shard for e in adopted})
        return adopted

    def commit(self) -> int:
        """Publish the new generation and release the store; returns the generation number."""
        try:
            return self.publish()
        finally:
            if not self._closed:
                self.release()

    def publish(self) -> int:
        """Publish the new generation (catalog and index together) and remove retired ones
        nobody reads, still holding the write lock (see `delete_unreferenced_shards`). When the
        catalog holds exactly what the current generation holds, nothing is published and the
        current generation number is returned (`unchanged`)."""
        if self._published:
            return self.generation
        try:
            self.transport.before_publish(self.catalog.reports.shards)  # asked only where it is needed (a scan)
        except BaseException:
            self.abort()
            raise
        vectors_changed = self.vectors is not None and (self.vectors.changed() or self.vectors.num_without_terms())
        if (
            self._base_rows is not None
            and not vectors_changed
            and not self.compacted
            and self.catalog.fingerprint() == self._base_rows
        ):
            return self._keep_current()
        try:
            manifest = self._write_vectors()
            if not self.compacted and self.catalog.delta_rows() > max(
                COMPACT_MIN_ROWS, COMPACT_SHARE * self.catalog.base_rows()
            ):
                self.compact()
            manifest["base"] = self.catalog.base_name()
            self.catalog.close()
            with open(self._partial, "rb") as f:
                os.fsync(f.fileno())
            write_manifest(self.root, self.generation, manifest)
            os.replace(self._partial, catalog_path(self.root, self.generation))
            fsync_dir(self.root)
            publish(self.root, self.generation)
        except _WRITE_ERRORS as exc:
            self.abort()
            raise write_error(self.root, exc) from exc
        self._published = True
        self.retired, self.held_by_readers = remove_retired(self.root, self.generation)
        remove_unshared(self.root)
        self.transport.published(self.generation)  # a failure leaves the store as it was (see store.remote)
        return self.generation

    def _write_vectors(self) -> dict:
        """Write the vector index's changes (ragkv.store.index.vectors keeps its own bounds) and record its
        tombstones in the delta; returns the manifest's vector part."""
        if self.vectors is None:
            return {"dim": 0, "segments": []}
        part = self.vectors.publish(f"{self.generation:06d}", self.catalog.documents.chunk_texts)
        self.catalog.tombstones.replace(self.vectors.gone)
        return part

    def compact_vectors(self) -> None:
        """Rewrite every live chunk of the index as one segment (see VectorIndex.compact)."""
        if self.vectors is not None:
            self.vectors.compact(f"{self.generation:06d}", self.catalog.documents.chunk_texts)

    def _keep_current(self) -> int:
        self.catalog.close()
        remove_unpublished(self.root, self.base_generation)
        self.generation, self.unchanged, self._published = self.base_generation, True, True
        # Generations retired earlier that readers held then may be free now.
        self.retired, self.held_by_readers = remove_retired(self.root, self.generation)
        return self.generation

    def delete_unreferenced_shards(self) -> tuple[int, int]:
        """After `publish`: delete shard files no generation on disk references (dead entries,
        rewritten shards, a killed writer's leftovers). Returns (files, bytes) deleted."""
        assert self._published and not self._closed, "publish first, while still holding the lock"
        referenced: set[str] = set()
        for generation in generations_on_disk(self.root):
            with Catalog(catalog_path(self.root, generation), read_only=True) as catalog:
                referenced |= catalog.reports.shards()
        files, freed = 0, remove_temporary(self.shard_dir)
        for shard, size in shard_files(self.shard_dir).items():
            if shard not in referenced:
                (self.shard_dir / shard).unlink(missing_ok=True)
                files, freed = files + 1, freed + size
        more_files, more_freed = self.transport.delete_unreferenced()
        return files + more_files, freed + more_freed

    def abort(self) -> None:
        """Drop the unpublished generation; the published store is as it was."""
        if self._closed:
            return
        if self._published:
            self.release()
            return
        try:
            self.catalog.close()
        except Exception:
            pass
        remove_unpublished(self.root, self.base_generation)
        created = self._created_root and self.base_generation is None
        self.release()
        if created:
            shutil.rmtree(self.root, ignore_errors=True)

    def release(self) -> None:
        self._closed = True
        try:
            self._lock.release()
        finally:
            self.transport.release()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        # Leaving the block normally publishes (unless already done) and releases; an error aborts.
        if exc_type is None:
            self.commit()
            return
        self.abort()
        if isinstance(exc, _WRITE_ERRORS):
            raise write_error(self.root, exc) from exc


def _is_key(name: str) -> bool:
    with contextlib.suppress(StoreFormatError):
        return bool(KVKey.from_string(name))
    return False


def open_writer(location: Path | str, wait: bool = False, rebuild_vectors: bool = False) -> StoreWriter:
    """A writer for the store at `location`: a folder, or s3://bucket/prefix. `rebuild_vectors`:
    start from an empty vector index instead of the published one (for repair)."""
    if not is_remote(location):
        return StoreWriter(location, wait, rebuild_vectors)
    transport = S3Transport.open(str(location), wait)
    try:
        writer = StoreWriter(transport.root, wait, rebuild_vectors, transport)
    except BaseException:
        transport.release()
        raise
    if writer.base_generation != transport.base:
        writer.abort()
        raise StoreWriteError(f"store {location}: the local mirror {writer.root} changed while opening; try again")
    return writer
