"""Opening a store to write: `open_writer` gives a StoreWriter over a folder, or for an S3
store over the local mirror with an `S3Transport`, which publishes to the bucket what the
writer builds in the mirror (store.remote)."""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from ragkv.core.errors import RagkvError, StoreLockedError, StoreWriteError
from ragkv.store.generations import LOCK, catalog_path
from ragkv.store.kv.remote_shards import UploadingShardWriter
from ragkv.store.kv.shards import ShardReader, ShardWriter
from ragkv.store.objects import is_remote, write_error
from ragkv.store.remote import RemoteStore
from ragkv.store.snapshot import SHARD_DIR
from ragkv.store.store_writer import StoreWriter

log = logging.getLogger("ragkv")


class S3Transport:
    """An S3 store's transport (see store.transport): the writer builds the next generation in
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
