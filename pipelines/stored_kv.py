"""Where KV a pipeline computes goes: the one home of compute, encode, seal into shards and
commit to the catalog, for ingest and repair."""

from __future__ import annotations

from ragkv.kv import codec
from ragkv.kv.entry import Entry
from ragkv.kv.layout import KVLayout
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
        layout: KVLayout | None = None,
    ):
        self.catalog = writer.catalog
        self.shards = writer.shard_writer(shard_bytes, metadata)
        self.profile_id = profile_id
        self.quant = quant
        self.layout = layout  # the model's: what codec.encode may leave out of sliding layers
        self.prefix_keys = {prefix_key} if prefix_key else set()
        self.replace = replace
        self.written = 0

    def put(self, key: str, entry: Entry) -> None:
        """Store `entry` (its KV and any state) as `key`."""
        self._commit(self.shards.add(key, codec.encode(entry, self.quant, self.layout)))

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
