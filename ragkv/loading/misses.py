"""KV the store has no entry for (a miss: the budget left it out, or a chunk given as text):
held from an earlier miss, left pending by another replica (S3), or computed now exactly as
ingest would, kept in the RAM tier and handed to the background write-back."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from ragkv.core.keys import KVKey
from ragkv.kv import cache as kv
from ragkv.kv import codec, spans
from ragkv.kv.entry import Entry, joined
from ragkv.loading.reader import Loaded, StoredReads, ms_since
from ragkv.model.forward import compute_spans
from ragkv.model.prompt import encode_text
from ragkv.store import ContextRow
from ragkv.store.kv.pending import PendingArea, PendingIndex
from ragkv.store.kv.writeback import ComputedKV, WriteBack, leaves_pending


class Misses:
    """Computes and writes back what `reads` (whose RAM tier it shares) cannot read."""

    def __init__(self, reads: StoredReads, write_back: bool, pending_bytes: int, leave_pending: bool):
        self.reads = reads
        self.lm, self.active, self.device = reads.lm, reads.active, reads.device
        self.write_back = write_back  # store KV computed on a miss (in the background, within the budget)
        self.pending_bytes = pending_bytes  # on S3: the most KV this reader leaves pending for a fold
        # leave computed KV pending for the writer's fold instead of taking the store's lock (always on S3)
        self.leave_pending = leaves_pending(reads.snapshot.location, leave_pending)
        self.writer: WriteBack | None = None  # the background write-back, once a miss started it
        # on S3: the KV other replicas computed and left pending, looked up before a miss is computed
        self.fleet = PendingIndex(PendingArea(reads.snapshot.location)) if self.leave_pending else None

    def span(
        self,
        rows: Sequence[ContextRow],
        chunk_ids: Sequence[tuple[int, ...]],
        keys: Sequence[KVKey],
        parent: str | None,
        before: list[Entry],
        loaded: Loaded,
    ) -> list[Entry]:
        """The entries of a span's chunks `rows` (their ids `chunk_ids`, keyed `keys`) the store
        has none for, computed after the prefix and `before` (the span's chunks before them, the
        last keyed `parent`; a chunk stored alone is a span of one): in one forward, or one per
        chunk for a model with recurrent layers (each keeps the state at its end); one entry per
        row, passed through the store's codec (so it equals what a later store read returns).
        Each is kept in the RAM tier and handed to the background write-back, chained to the
        entry before it."""
        profile, separator = self.active.profile, self.active.layout.separator_ids
        segments = [
            spans.segment(0 if row.starts_span else 1, ids, separator) for row, ids in zip(rows, chunk_ids, strict=True)
        ]
        start = time.perf_counter()
        base = joined([self.reads.prefix(), *before])
        layout = kv.layout_of(self.lm.model.config)
        flat = sum(map(len, segments))  # the span in one batch of its own
        ((_, pieces),) = compute_spans(self.lm.model, base, [segments], flat, self.lm.pad_id)
        computed = []
        for row, ids, key, piece in zip(rows, chunk_ids, keys, pieces, strict=True):
            name = key.to_string()
            parts = codec.encode(piece, profile.kv_quant, layout)
            entry = codec.decode({n: t.to(self.device) for n, t in parts.items()}, self.lm.model.dtype)
            self.reads.ram.put(self.reads.ram_key(name), entry)
            loaded.kv_sources[row.chunk_id] = "computed"
            self._write_back(row, name, ids, parts, parent)
            computed.append(entry)
            parent = name
        loaded.kv_compute_ms += ms_since(start)
        return computed

    def chunk(self, row: ContextRow, loaded: Loaded) -> Entry:
        """The entry of a chunk stored alone the store has none for: from the RAM
        tier if computed earlier, else computed now after the prefix, exactly as ingest would
        (see `span`)."""
        token_ids = row.token_ids if row.token_ids is not None else self._text_ids(row)
        key = KVKey.for_chunk(self.active.profile, token_ids)
        held = self.held(row, key.to_string(), loaded)
        if held is not None:
            return held
        return self.span([row], [token_ids], [key], None, [], loaded)[0]

    def held(self, row: ContextRow, key: str, loaded: Loaded) -> Entry | None:
        """KV the store has no entry for that is ready all the same: computed on an earlier
        miss (the RAM tier), or, on S3, by another replica that left it pending for the fold
        (read from the bucket, verified, counted as a store hit)."""
        held = self.reads.ram.get(self.reads.ram_key(key))
        if held is not None:
            loaded.ram_hits += 1
            loaded.kv_sources[row.chunk_id] = "ram"
            return held
        parts = self.fleet.find(key) if self.fleet is not None else None
        if parts is None:
            return None
        entry = codec.decode({n: t.to(self.device) for n, t in parts.items()}, self.lm.model.dtype)
        self.reads.ram.put(self.reads.ram_key(key), entry)
        loaded.kv_sources[row.chunk_id] = "store"
        return entry

    def _write_back(
        self, row: ContextRow, key: str, token_ids: tuple[int, ...], parts: dict[str, torch.Tensor], parent: str | None
    ) -> None:
        """Hand KV computed on a miss (encoded `parts`) to the background write-back, if on."""
        writer = self._background_writer()
        if writer is None:
            return
        profile = self.active.profile
        metadata = codec.shard_metadata(
            profile.profile_id, self.lm.facts.name, profile.dtype, kv.layout_of(self.lm.model.config).name
        )
        writer.submit(
            ComputedKV(profile.profile_id, key, row.chunk_id, token_ids, parts, metadata, row.span_start, parent)
        )

    def _text_ids(self, row: ContextRow) -> tuple[int, ...]:
        return tuple(encode_text(self.lm.tokenizer, row.text))

    def _background_writer(self) -> WriteBack | None:
        """The background write-back (started on the first miss), or None when off (opened
        with write_back=False). On S3 (or with leave_pending) it leaves the KV pending, for the
        store's writer to fold."""
        if self.writer is None and self.write_back:
            self.writer = WriteBack(self.reads.snapshot.location, self.pending_bytes, self.leave_pending)
        return self.writer

    def written_back(self) -> int:
        """Entries of KV computed on a miss that this reader's write-back stored so far."""
        return self.writer.report.stored if self.writer is not None else 0

    def pending_uploaded(self) -> int:
        """Bytes of computed KV this reader left pending for the writer's fold (S3)."""
        return self.writer.pending.report.bytes if self.writer and self.writer.pending else 0

    def pending_dropped(self) -> int:
        """Computed KV entries this reader dropped to stay within its pending bound (S3)."""
        return self.writer.pending.report.dropped_entries if self.writer and self.writer.pending else 0

    def flush(self) -> None:
        """Wait until KV computed on misses so far is written to the store (or given up)."""
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
