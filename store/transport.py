"""Where a store writer's files go: the writer builds each generation in a local folder and
hands what leaves it to a transport. `LocalTransport`: the folder is the store, nothing
leaves. An S3 store's transport (store.writer.S3Transport) uploads shards as they are sealed
and the generation once published. Serialisation (shards, catalog, index) is the writer's;
only where the bytes end up is the transport's."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from ragkv.store.kv.shards import ShardReader, ShardWriter, shard_files
from ragkv.store.snapshot import SHARD_DIR


class Transport(Protocol):
    root: Path  # the local folder the writer builds generations in

    @property
    def location(self) -> str:
        """What the user named: the folder, or the s3:// URI."""
        ...

    def shard_writer(self, max_bytes: int, metadata: dict[str, str]) -> ShardWriter: ...

    def shard_sizes(self) -> dict[str, int]:
        """The store's sealed shard files and their sizes."""
        ...

    def shard_reader(self) -> ShardReader: ...

    def adopted(self, shards: set[str]) -> None:
        """`shards`, sealed in the folder by a killed writer, are now referenced: make them the store's."""
        ...

    def before_publish(self, shards: Callable[[], set[str]]) -> None:
        """Each shard the new generation references (`shards()`, a scan of the catalog: call it
        only when needed) must be in the store before it is published."""
        ...

    def published(self, generation: int) -> None:
        """`generation` is published in the folder: publish it where the store is."""
        ...

    def delete_unreferenced(self) -> tuple[int, int]:
        """Delete shards the store holds beyond the folder that no kept generation references;
        returns (files, bytes) deleted."""
        ...

    def release(self) -> None:
        """The writer is done: release whatever the transport holds (a lock)."""
        ...


class LocalTransport:
    """A store in a local folder: shards are written, read and deleted where they lie."""

    def __init__(self, root: Path):
        self.root = root

    @property
    def location(self) -> str:
        return str(self.root)

    def shard_writer(self, max_bytes: int, metadata: dict[str, str]) -> ShardWriter:
        return ShardWriter(self.root / SHARD_DIR, max_bytes, metadata)

    def shard_sizes(self) -> dict[str, int]:
        return shard_files(self.root / SHARD_DIR)

    def shard_reader(self) -> ShardReader:
        return ShardReader(self.root / SHARD_DIR)

    def adopted(self, shards: set[str]) -> None:
        pass  # they are in the store already

    def before_publish(self, shards: Callable[[], set[str]]) -> None:
        pass  # the writer's folder is the store

    def published(self, generation: int) -> None:
        pass

    def delete_unreferenced(self) -> tuple[int, int]:
        return 0, 0  # the writer deletes the folder's own

    def release(self) -> None:
        pass
