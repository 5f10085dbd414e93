"""Where a store writer's files go: the writer builds each generation in a local folder and
hands what leaves it to a transport. `LocalTransport`: the folder is the store, nothing
leaves. `S3Transport`: the folder is this machine's mirror of the bucket (store.remote); shards
are uploaded as they are sealed and the generation once published, under the bucket's `LOCK`
object (`BucketLock`). Serialisation (shards, catalog, index) is the writer's;
only where the bytes end up is the transport's."""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from ragkv.core.errors import RagkvError, StoreLockedError, StoreWriteError
from ragkv.store.generations import LOCK, catalog_path
from ragkv.store.kv.remote_shards import UploadingShardWriter
from ragkv.store.kv.shards import ShardReader, ShardWriter, shard_files
from ragkv.store.objects import write_error
from ragkv.store.remote import RemoteStore
from ragkv.store.snapshot import SHARD_DIR

log = logging.getLogger("ragkv")


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


class S3Transport:
    """An S3 store's transport (see above): the writer builds the next generation in
    this machine's mirror of the bucket (store.remote); each shard is uploaded as it is sealed,
    and catalog, index and then CURRENT once the mirror publishes. `open` takes the bucket's
    LOCK object (the mirror's own lock is the writer's) and syncs the mirror."""

    def __init__(self, remote: RemoteStore, lock: BucketLock, base: int | None):
        self.remote = remote
        self.root = remote.mirror
        self.base = base  # the generation the bucket had published when the lock was taken
        self._lock = lock

    @classmethod
    def open(cls, uri: str, wait: bool) -> S3Transport:
        remote = RemoteStore(uri)
        lock = BucketLock(remote)
        try:
            lock.take(wait)
        except OSError as exc:
            raise write_error(uri, exc) from exc
        try:
            return cls(remote, lock, remote.sync())
        except BaseException:
            lock.release()
            raise

    @property
    def location(self) -> str:
        return self.remote.location.uri

    def shard_writer(self, max_bytes: int, metadata: dict[str, str]) -> ShardWriter:
        return UploadingShardWriter(self.remote, max_bytes, metadata)

    def shard_sizes(self) -> dict[str, int]:
        return self.remote.shards()

    def shard_reader(self) -> ShardReader:
        return ShardReader(self.root / SHARD_DIR, self.remote.copies)

    def adopted(self, shards: set[str]) -> None:
        if shards:  # sealed in the mirror by a killed writer: maybe never uploaded
            self._upload(shards - set(self.remote.shards()))

    def before_publish(self, shards: Callable[[], set[str]]) -> None:
        try:
            missing = shards() - set(self.remote.shards())
        except OSError as exc:
            raise write_error(self.location, exc) from exc
        for shard in sorted(missing):
            if not (self.root / SHARD_DIR / shard).exists():
                raise StoreWriteError(
                    f"cannot publish {self.location}: shard {shard} is neither on the bucket nor in the local mirror"
                )
        self._upload(missing)

    def _upload(self, shards: set[str]) -> None:
        try:
            for shard in sorted(shards):
                self.remote.upload_shard(shard)
        except OSError as exc:
            raise write_error(self.location, exc) from exc

    def published(self, generation: int) -> None:
        try:
            self.remote.upload_generation(generation)
        except OSError as exc:  # the mirror is ahead of the bucket; the next sync puts it back
            raise write_error(self.location, exc) from exc
        try:
            self.remote.trim_generations(generation)
        except OSError as exc:  # published already; old generations stay until the next writer
            log.warning("store %s: could not delete old generations: %s", self.location, exc)

    def delete_unreferenced(self) -> tuple[int, int]:
        files = freed = 0
        referenced = referenced_shards(self.remote, self.remote.remote_generations())
        for shard, size in self.remote.shards().items():
            if shard not in referenced:
                self.remote.delete_shard(shard)
                files, freed = files + 1, freed + size
        return files, freed

    def release(self) -> None:
        try:
            self._lock.release()
        except (OSError, RagkvError) as exc:
            log.warning("store %s: could not delete its LOCK object (%s); delete it by hand", self.location, exc)


class BucketLock:
    """An S3 store's `LOCK` object, held by its one writer. Advisory (S3 offers no atomic
    create here): a LOCK left by a dead writer on this machine is taken over; one from another
    machine names its holder, to be deleted by hand if it is gone."""

    def __init__(self, remote: RemoteStore):
        self.remote = remote
        self.token = uuid.uuid4().hex

    def take(self, wait: bool) -> None:
        holder = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "token": self.token,
        }
        uri = self.remote.location.uri
        while (data := self.remote.read_object(LOCK)) is not None:
            other = _parse_lock(data)
            if other.get("host") == socket.gethostname() and not _alive(other.get("pid")):
                break  # left by a writer on this machine that died (killed, crashed): take over
            if not wait:
                raise StoreLockedError(
                    f"store {uri} is being written by {other.get('host')} pid {other.get('pid')} "
                    f"since {other.get('since')}; wait for it, pass --wait, or delete {uri}/LOCK "
                    "if that writer is gone"
                )
            time.sleep(1.0)
        self.remote.put_object(LOCK, json.dumps(holder).encode())

    def release(self) -> None:
        """Delete the LOCK object if it is still this writer's."""
        data = self.remote.read_object(LOCK)
        if data is not None and _parse_lock(data).get("token") == self.token:
            self.remote.delete_object(LOCK)


def _parse_lock(data: bytes) -> dict:
    try:
        return json.loads(data or b"{}")
    except ValueError:
        return {}


def _alive(pid) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return True  # unknown: assume held
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def referenced_shards(remote: RemoteStore, generations: set[int]) -> set[str]:
    """Shards the catalogs of `generations` on the bucket reference (catalogs copied down)."""
    from ragkv.store.catalog import Catalog

    referenced: set[str] = set()
    for generation in generations:
        path = catalog_path(remote.mirror, generation)
        remote.fetch_generation(generation, fresh=False)
        with Catalog(path, read_only=True) as catalog:
            referenced |= catalog.reports.shards()
    return referenced
