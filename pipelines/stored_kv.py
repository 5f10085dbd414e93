"""Where KV a pipeline computes goes: the one home of compute, encode, seal into shards and
commit to the catalog, for ingest and repair."""

from __future__ import annotations

from collections.abc import Sequence

from ragkv.kv import codec
from ragkv.store import StoreWriter


class StoredKV:
    """KV into the writer's next generation: each entry encoded as the profile stores it
    (`quant`), queued into shards of about `shard_bytes`, and the entries of every shard that
    seals committed to the catalog at once (so a crash loses at most the unsealed ones).
    `replace`: entries already in the catalog under the same keys are replaced (a repair)."""

    def __init__(
        self,
        writer: StoreWriter,
        profile_id: str,
        quant: str,
        prefix_key: str | None,
        shard_bytes: int,
        metadata: dict[str, str],
        replace: bool = False,
        windows: Sequence[int | None] = (),
    ):
        self.catalog = writer.catalog
        self.shards = writer.shard_writer(shard_bytes, metadata)
        self.profile_id = profile_id
        self.quant = quant
        self.windows = tuple(windows)  # the layout's sliding windows: what codec.encode may leave out
        self.prefix_keys = {prefix_key} if prefix_key else set()
        self.replace = replace
        self.written = 0

    def put(self, key: str, kv_tensor) -> None:
        """Store `kv_tensor` `(L, 2, H, T, D)` as `key`."""
        self._commit(self.shards.add(key, codec.encode(kv_tensor, self.quant, self.windows)))

    def flush(self) -> None:
        """Seal and commit whatever is queued."""
        self._commit(self.shards.flush())

    def _commit(self, sealed) -> None:
        if not sealed:
            return
        if self.replace:
            self.catalog.entries.delete_entries(e.name for e in sealed)
        self.catalog.entries.add_entries(self.profile_id, sealed, self.prefix_keys)
        self.written += len(sealed)
