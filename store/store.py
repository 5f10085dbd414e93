"""Opening a store to read (a snapshot of the published generation) or to write (a new one)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ragkv.errors import InputError, StoreEmptyError, StoreFormatError, StoreNotFoundError
from store.catalog import Catalog
from store.generations import (
    WriteLock, catalog_path, is_store_file, publish, read_current, remove_generations, vectors_path,
)
from store.shards import ShardReader, ShardWriter, fsync_dir
from store.vectors import VectorIndex

SHARD_DIR = "shards"


def is_store(root: Path) -> bool:
    return read_current(Path(root)) is not None


def _is_foreign(root: Path) -> bool:
    """A path that holds something other than a ragkv store (never write into it)."""
    if not root.is_dir():
        return True
    return not is_store(root) and any(not (is_store_file(p.name) or p.name == SHARD_DIR) for p in root.iterdir())


class StoreSnapshot:
    """A read-only view of one published generation: catalog, vectors and shard reader."""

    def __init__(self, root: Path, generation: int):
        self.root = root
        self.generation = generation
        self.catalog = Catalog(catalog_path(root, generation), read_only=True)
        index_file = vectors_path(root, generation)
        if not index_file.is_file():
            self.catalog.close()
            raise StoreFormatError(f"store {root} generation {generation} has no vector index {index_file.name}")
        self.vectors = VectorIndex.load(index_file)
        self.shards = ShardReader(root / SHARD_DIR)

    def close(self) -> None:
        self.shards.close()
        self.catalog.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_snapshot(root: Path | str, require_documents: bool = True) -> StoreSnapshot:
    """Open the published generation of the store at `root`."""
    root = Path(root)
    for _ in range(3):  # the generation may be replaced between reading CURRENT and opening it
        generation = read_current(root)
        if generation is None:
            raise StoreNotFoundError(f"no ragkv store at {root}; create one with: ragkv ingest DOCS --store {root}")
        if catalog_path(root, generation).is_file():
            break
    else:
        raise StoreFormatError(f"store {root}: CURRENT names generation {generation} but its catalog is missing")
    snapshot = StoreSnapshot(root, generation)
    if require_documents and len(snapshot.vectors) == 0:
        snapshot.close()
        raise StoreEmptyError(f"store {root} holds no documents; add some with: ragkv ingest DOCS --store {root}")
    return snapshot


class StoreWriter:
    """Builds the next generation of a store; `commit` publishes it, `abort` leaves no trace.

    Holds the store's write lock from construction to commit/abort. The catalog and vector
    index are copies of the current generation; shards sealed during the write are removed
    again on abort.
    """

    def __init__(self, root: Path | str, wait: bool = False):
        self.root = Path(root)
        self._created_root = not self.root.exists()
        if not self._created_root and _is_foreign(self.root):
            raise InputError(f"{self.root} exists and is not a ragkv store; pass an empty or new directory as --store")
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = WriteLock(self.root, wait)
        try:
            self.base_generation = read_current(self.root)
            self.generation = (self.base_generation or 0) + 1
            remove_generations(self.root, keep={self.base_generation} if self.base_generation else set())
            self._partial = catalog_path(self.root, self.generation).with_suffix(".duckdb.partial")
            if self.base_generation is not None:
                shutil.copyfile(catalog_path(self.root, self.base_generation), self._partial)
                self.vectors: VectorIndex | None = VectorIndex.load(vectors_path(self.root, self.base_generation))
            else:
                self.vectors = None
            self.catalog = Catalog(self._partial, read_only=False)
        except BaseException:
            self._lock.release()
            raise
        self._new_shards: list[str] = []
        self._closed = False

    @property
    def shard_dir(self) -> Path:
        return self.root / SHARD_DIR

    def shard_writer(self, max_bytes: int, metadata: dict[str, str]) -> ShardWriter:
        return _TrackingShardWriter(self, self.shard_dir, max_bytes, metadata)

    def ensure_vectors(self, dim: int) -> VectorIndex:
        if self.vectors is None:
            self.vectors = VectorIndex.empty(dim)
        elif self.vectors.dim != dim:
            raise StoreFormatError(f"store {self.root} holds {self.vectors.dim}-dim vectors, the embedder gives {dim}")
        return self.vectors

    def commit(self) -> int:
        """Publish the new generation (catalog and index together); returns its number."""
        if self._closed:
            return self.generation
        self.catalog.close()
        with open(self._partial, "rb") as f:
            os.fsync(f.fileno())
        (self.vectors or VectorIndex.empty(1)).save(vectors_path(self.root, self.generation))
        os.replace(self._partial, catalog_path(self.root, self.generation))
        fsync_dir(self.root)
        publish(self.root, self.generation)
        # Keep the previous generation: a reader may be between reading CURRENT and opening it.
        remove_generations(self.root, keep={self.generation, self.base_generation or 0})
        self._finish()
        return self.generation

    def abort(self) -> None:
        """Drop everything this write produced; the published store is as it was."""
        if self._closed:
            return
        try:
            self.catalog.close()
        except Exception:
            pass
        remove_generations(self.root, keep={self.base_generation} if self.base_generation else set())
        for shard in self._new_shards:
            (self.shard_dir / shard).unlink(missing_ok=True)
        created = self._created_root and self.base_generation is None
        self._finish()
        if created:
            shutil.rmtree(self.root, ignore_errors=True)

    def _finish(self) -> None:
        self._closed = True
        self._lock.release()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        # Leaving the block normally publishes (unless already committed); an error aborts.
        if exc_type is None:
            self.commit()
        else:
            self.abort()


class _TrackingShardWriter(ShardWriter):
    """Remembers the shards it sealed so that the owning write can remove them on abort."""

    def __init__(self, owner: StoreWriter, *args):
        super().__init__(*args)
        self._owner = owner

    def flush(self):
        entries = super().flush()
        if entries:
            self._owner._new_shards.append(entries[0].shard)
        return entries
