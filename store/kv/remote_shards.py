"""Writing KV shards into an S3 store: sealed in the local mirror, uploaded before any catalog
row names them."""

from __future__ import annotations

from pathlib import Path

from ragkv.store.kv.shards import SealedEntry, ShardWriter
from ragkv.store.objects import is_remote, write_error
from ragkv.store.remote import RemoteStore


class UploadingShardWriter(ShardWriter):
    """Seals shards locally (in the mirror), then uploads each before reporting its entries,
    so a catalog row is only ever committed for a shard already on the bucket."""

    def __init__(self, remote: RemoteStore, max_bytes: int, metadata: dict[str, str]):
        super().__init__(remote.mirror / "shards", max_bytes, metadata)
        self.remote = remote

    def flush(self) -> list[SealedEntry]:
        sealed = super().flush()
        for shard in {e.shard for e in sealed}:
            try:
                self.remote.upload_shard(shard)
            except OSError as exc:
                raise write_error(self.remote.location.uri, exc) from exc
        return sealed


class ShardSink:
    """Where a Ray worker seals a batch's KV: one shard, in a local store or uploaded."""

    def __init__(self, target: str, metadata: dict[str, str]):
        if is_remote(target):
            self._writer: ShardWriter = UploadingShardWriter(RemoteStore(target), 1 << 62, metadata)
        else:
            self._writer = ShardWriter(Path(target) / "shards", 1 << 62, metadata)

    def add(self, name: str, parts) -> None:
        self._writer.add(name, parts)

    def seal(self) -> list[SealedEntry]:
        return self._writer.flush()
