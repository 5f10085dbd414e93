"""Moving KV between a ragkv store and a serving engine, engine-neutral: a stored entry read for
loading (`load_kv`: from the published store, or a replica's pending KV), the slots a token
range takes in a paged cache, and `KVSaver`, which stores what the engine computed, in the
background, through the store's write-back (ragkv.integrations.store_match says which entries)."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ragkv.core.errors import StoreCorruptError
from ragkv.core.keys import Profile
from ragkv.kv import codec
from ragkv.kv.entry import Entry, joined
from ragkv.kv.layout import KVLayout
from ragkv.store import EntryRow, open_snapshot
from ragkv.store.kv.pending import PendingArea, read_pending
from ragkv.store.kv.shards import ShardReader

if TYPE_CHECKING:
    from ragkv.integrations.store_match import SaveTarget

log = logging.getLogger("ragkv")

TIMINGS_KEPT = 4096  # recent copy timings a long-running engine keeps (to log their p50)


def load_kv(
    shards: ShardReader,
    entries: Sequence[EntryRow],
    dtype: torch.dtype,
    pending: frozenset[str] = frozenset(),
    area: PendingArea | None = None,
    store: str | Path | None = None,
) -> Entry:
    """The entries joined along the tokens (the last one's state, for recurrent layers), the KV
    in `dtype`, each verified: from the store's shards, and those whose key is in `pending`
    (another replica left them for the fold) from the pending `area`, or, if the fold took one
    meanwhile and deleted it there, from `store`'s newest generation."""
    parts = []
    for entry in entries:
        if entry.kv_key not in pending:
            parts.append(codec.read(shards, entry, dtype))
            continue
        assert area is not None and store is not None, "pending entries are read from the pending area"
        try:
            parts.append(codec.decode(read_pending(area, entry.shard, entry.kv_key, entry.checksum), dtype))
        except (OSError, StoreCorruptError):
            parts.append(_read_folded(store, entry.kv_key, dtype))
    return joined(parts)


def _read_folded(store: str | Path, key: str, dtype: torch.dtype) -> Entry:
    """Entry `key` from `store`'s newest generation (a fold took it from pending/)."""
    with open_snapshot(store, require_documents=False) as snapshot:
        entry = snapshot.catalog.entries.entry(key)
        if entry is None:
            raise StoreCorruptError(f"entry {key[:12]} left pending is neither pending nor stored")
        return codec.read(snapshot.shards, entry, dtype)


def slot_mapping(block_ids: Sequence[int], block_size: int, start: int, end: int) -> torch.Tensor:
    """Paged-cache slots of token positions start..end-1: block `p // block_size` of the
    request's blocks, offset `p % block_size`. `(end - start,)` int64."""
    positions = torch.arange(start, end)
    blocks = torch.tensor(list(block_ids), dtype=torch.long)[positions // block_size]
    return blocks * block_size + positions % block_size


class KVSaver:
    """Hands KV an engine computed to the store's write-back, off the engine's thread: a thread
    waits for each gathered copy (an event, on CUDA), encodes it as the store does, and submits
    it to `ragkv.store.kv.writeback.WriteBack` (which batches, admits by budget and publishes).

    `wait=True` (an ingest): a full write-back queue makes `submit` wait instead of dropping.
    `layout`: the model's (a sliding layer is stored as ingest stores it: what a continuation
    reads). `options`: the WriteBack's (`pending_bytes`, `leave_pending`, `writer`)."""

    def __init__(
        self,
        store: str | Path,
        profile: Profile,
        model_name: str,
        engine: str,
        wait: bool = False,
        layout: KVLayout | None = None,
        **options: Any,
    ):
        import queue
        import threading

        from ragkv.store.kv.writeback import WriteBack

        self.profile = profile
        self.layout = layout
        name = layout.name if layout is not None else "L2HTD"
        self.metadata = {**codec.shard_metadata(profile.profile_id, model_name, profile.dtype, name), "engine": engine}
        self.write_back = WriteBack(store, **options)
        self.wait = wait
        self.copy_ms: deque[float] = deque(maxlen=TIMINGS_KEPT)  # per save: step time spent copying its KV out
        self.saves = 0
        self._queue: queue.Queue = queue.Queue(maxsize=64 if wait else 0)
        self._thread = threading.Thread(target=self._run, name="ragkv-save", daemon=True)
        self._thread.start()

    def submit(self, target: SaveTarget, kv_tensor: torch.Tensor, event=None, copy_ms: float = 0.0) -> None:
        """Save `kv_tensor` `(L, 2, H, T, D)` (ready once `event` is, when given) as `target`."""
        self.copy_ms.append(copy_ms)
        self.saves += 1
        if self.saves % 50 == 0:
            self.log_copies()
        self._queue.put((target, kv_tensor, event))

    def log_copies(self) -> None:
        if self.copy_ms:
            ordered = sorted(self.copy_ms)
            log.info(
                "ragkv: %d chunks copied out to save; step time spent copying (last %d) p50 %.2f ms, max %.2f ms",
                self.saves,
                len(ordered),
                ordered[len(ordered) // 2],
                ordered[-1],
            )

    def _run(self) -> None:
        from ragkv.store.kv.writeback import ComputedKV

        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                target, kv_tensor, event = item
                if event is not None:
                    event.synchronize()
                parts = codec.encode(Entry.of(kv_tensor.cpu()), self.profile.kv_quant, self.layout)
                computed = ComputedKV(
                    self.profile.profile_id,
                    target.kv_key,
                    target.chunk_id,
                    target.token_ids,
                    parts,
                    self.metadata,
                    span_start=target.span_start,
                    parent=target.parent,
                )
                self.write_back.submit(computed, wait=self.wait)
            except Exception:  # a bug here must not stop later saves, nor the engine
                log.exception("could not hand computed KV to the store")
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        """Wait until everything submitted so far is written (or given up)."""
        self._queue.join()
        self.write_back.flush()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        self.write_back.close()
        self.log_copies()
