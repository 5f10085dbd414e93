"""Opening a store to read: a snapshot of its published generation, leased until closed."""

from __future__ import annotations

import time
from pathlib import Path

from ragkv.core.errors import StoreCorruptError, StoreEmptyError, StoreFormatError, StoreNotFoundError
from ragkv.store.catalog import Catalog
from ragkv.store.generations import (
    SEGMENT_DIR,
    ReaderLease,
    RetiredError,
    catalog_path,
    is_legacy,
    is_store_file,
    read_current,
    read_manifest,
    vectors_path,
)
from ragkv.store.index.segments import SegmentInfo, open_flat_file
from ragkv.store.index.vectors import VectorIndex
from ragkv.store.kv.pending_hits import PendingHits
from ragkv.store.kv.popularity import HitLog
from ragkv.store.kv.shards import ShardReader, is_shard_name
from ragkv.store.objects import FolderObjects, Objects, is_remote
from ragkv.store.remote import RemoteStore

SHARD_DIR = "shards"
REMOTE_POLL_S = 2.0  # how often a long-lived reader asks an S3 store for a newer generation


class StoreSnapshot:
    """A read-only view of one published generation: catalog, vectors and shard reader.
    Holds the generation's reader lease until `close`. For an S3 store, `root` is the local
    mirror and `remote` the bucket shards are fetched from."""

    def __init__(self, root: Path, generation: int, remote: RemoteStore | None = None, lenient: bool = False):
        self.root = root
        self.remote = remote
        self.objects: Objects = remote if remote is not None else FolderObjects(root)
        self._polled = time.monotonic()  # when the bucket's CURRENT was last read
        self.generation = generation
        self._lease = ReaderLease(root, generation)
        try:
            # First: a store of a newer ragkv is refused as such, before its catalog is read.
            self._manifest = None if is_legacy(root, generation) else read_manifest(root, generation)
            self.catalog = Catalog(catalog_path(root, generation), read_only=True)
            self.vectors_damage = ""  # lenient: why the vector index could not be read (it is then empty)
            try:
                self.vectors = self._open_vectors()
            except StoreCorruptError as exc:
                if not lenient:
                    raise
                self.vectors, self.vectors_damage = VectorIndex.empty(0), str(exc)
        except BaseException:
            self._lease.release()
            raise
        self.shards = ShardReader(root / SHARD_DIR, remote.copies if remote is not None else None)

    def _open_vectors(self) -> VectorIndex:
        manifest = self._manifest
        if manifest is None:  # format 1: one index file
            path = vectors_path(self.root, self.generation)
            segment = open_flat_file(path, path.name, self.root)
            return VectorIndex(segment.index.d, self.root, (segment.info,), loaded={path.name: segment})
        vectors = VectorIndex(
            int(manifest.get("dim", 0)),
            self.root / SEGMENT_DIR,
            [SegmentInfo.from_dict(s) for s in manifest["segments"]],
            self.catalog.tombstones.ids(),
        )
        vectors.load_all()
        return vectors

    @property
    def written_by(self) -> str:
        """Which ragkv wrote this generation (format-1 stores predate the record)."""
        if self._manifest is None:
            return "0.1.x (store format 1)"
        return self._manifest.get("written_by", "0.1.x")

    @property
    def location(self) -> str:
        """What the user named: the folder, or the s3:// URI."""
        return self.objects.uri

    def shard_sizes(self) -> dict[str, int]:
        """Every sealed shard the store holds, with its size in bytes."""
        return {name: size for name, size in self.objects.names(SHARD_DIR).items() if is_shard_name(name)}

    def use_log(self) -> HitLog | PendingHits:
        """Where a reader logs the chunks its prompts used: the store's hit log, or where the
        store is shared by readers that never take its lock (S3), objects under pending/ that
        the writer folds."""
        return PendingHits(self.location) if self.objects.shared else HitLog(self.root)

    def latest_generation(self) -> int | None:
        """The generation published now. An S3 store is asked at most every REMOTE_POLL_S
        seconds (a GET per question would add a round trip to every answer); its catalog and
        index are copied down when they change."""
        if not self.remote:
            return read_current(self.root)
        now = time.monotonic()
        if now - self._polled < REMOTE_POLL_S:
            return self.generation
        self._polled = now
        return self.remote.sync()

    def close(self) -> None:
        self.shards.close()
        self.catalog.close()
        self._lease.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def shard_reader(location: Path | str) -> ShardReader:
    """A reader of the shards of the store at `location` (a folder, or s3://bucket/prefix: then
    its local mirror's copies, fetched from the bucket when missing), without opening a
    generation: for a process that is handed entries to read (a serving engine's worker)."""
    if is_remote(location):
        remote = RemoteStore(str(location))
        return ShardReader(remote.mirror / SHARD_DIR, remote.copies)
    return ShardReader(Path(location) / SHARD_DIR)


def open_snapshot(location: Path | str, require_documents: bool = True, lenient: bool = False) -> StoreSnapshot:
    """Open the published generation of the store at `location` (a folder or s3://bucket/prefix).
    `lenient` (verify, repair): open it even if its vector index is unreadable (see
    `StoreSnapshot.vectors_damage`)."""
    remote = RemoteStore(str(location)) if is_remote(location) else None
    root = remote.mirror if remote else Path(location)
    if not remote and root.exists() and not root.is_dir():
        raise StoreNotFoundError(f"{location} is a file, not a ragkv store (a folder made by ragkv ingest)")
    for _ in range(5):  # the generation may be retired between reading CURRENT and leasing it
        generation = remote.sync() if remote else read_current(root)
        if generation is None:
            raise StoreNotFoundError(
                f"no ragkv store at {location}; create one with: ragkv ingest DOCS --store {location}"
            )
        try:
            snapshot = StoreSnapshot(root, generation, remote, lenient)
            break
        except RetiredError:
            continue
    else:
        raise StoreFormatError(f"store {root}: CURRENT names generation {generation} but its files are missing")
    if require_documents and len(snapshot.vectors) == 0:
        snapshot.close()
        raise StoreEmptyError(
            f"store {location} holds no documents; add some with: ragkv ingest DOCS --store {location}"
        )
    return snapshot


def is_store(root: Path) -> bool:
    return read_current(Path(root)) is not None


def is_foreign(root: Path) -> bool:
    """A path that holds something other than a ragkv store (never write into it)."""
    if not root.is_dir():
        return True
    return not is_store(root) and any(
        not (is_store_file(p.name) or p.name in (SHARD_DIR, SEGMENT_DIR)) for p in root.iterdir()
    )
