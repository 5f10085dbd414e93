"""KV loading on the online path: the prompt's stored KV, read and verified (through a RAM tier
and reused read buffers), the prefix and separator KV, KV computed on a miss and written back,
and the cache each `--mode` assembles from them (see ragkv.modes.assemble)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from ragkv.core.config import AskSettings
from ragkv.core.errors import StoreCorruptError
from ragkv.core.keys import KVKey
from ragkv.core.lru import ByteLRU
from ragkv.kv import cache as kv
from ragkv.kv import codec, spans
from ragkv.model.forward import compute_chunks, shard_metadata, split_segments
from ragkv.model.llm import LoadedModel
from ragkv.model.profiles import ActiveProfile
from ragkv.model.prompt import encode_text
from ragkv.modes import assemble
from ragkv.modes.assemble import Assembly
from ragkv.modes.prefix_cache import PrefixCache
from ragkv.store import ContextRow, StoreSnapshot
from ragkv.store.kv.pending import PendingArea, PendingHits, PendingIndex
from ragkv.store.kv.popularity import HitLog, Use
from ragkv.store.kv.writeback import PENDING_BYTES, ComputedKV, WriteBack, leaves_pending

log = logging.getLogger("ragkv")


@dataclass
class Loaded:
    """What `KVLoader.load` assembled for a prompt, and how."""

    assembly: Assembly
    kv_quant: str = "none"  # how the reused KV was stored
    fallback: bool = False  # the mode could not be used: the prompt is prefilled in full
    kv_sources: dict[int, str] = field(default_factory=dict)  # chunk id -> "store", "ram" or "computed"
    ram_hits: int = 0
    ram_misses: int = 0
    kv_read_ms: float = 0.0
    assemble_ms: float = 0.0
    kv_compute_ms: float = 0.0
    warnings: list[str] = field(default_factory=list)


class KVLoader:
    """Loads one profile's stored KV from one open generation (`switch` moves it)."""

    def __init__(
        self,
        snapshot: StoreSnapshot,
        lm: LoadedModel,
        active: ActiveProfile,
        device: str,
        prefix_cache_bytes: int,
        ram_bytes: int,
        write_back: bool,
        log_uses: bool = True,
        pending_bytes: int = PENDING_BYTES,
        leave_pending: bool = False,
    ):
        self.snapshot = snapshot
        self.lm = lm
        self.active = active
        self.device = device
        self.prefix_cache = PrefixCache(prefix_cache_bytes)
        self.ram: ByteLRU[torch.Tensor] = ByteLRU(ram_bytes)  # hot chunk KV by key, verified when loaded
        self.write_back = write_back  # store KV computed on a miss (in the background, within the budget)
        self.pending_bytes = pending_bytes  # on S3: the most KV this reader leaves pending for a fold
        # leave computed KV pending for the writer's fold instead of taking the store's lock (always on S3)
        self.leave_pending = leaves_pending(snapshot.location, leave_pending)
        self._prefix_kv: torch.Tensor | None = None  # pinned in memory after the first load
        self._separator: torch.Tensor | None = None
        self._read_buffers: list[torch.Tensor] = []  # stored KV is read into these (reused memory)
        self.writer: WriteBack | None = None  # the background write-back, once a miss started it
        # on S3: the KV other replicas computed and left pending, looked up before a miss is computed
        self.fleet = PendingIndex(PendingArea(snapshot.location)) if self.leave_pending else None
        # on S3 a reader never writes the store: its uses wait under pending/ for the writer's fold
        self._hit_log: HitLog | PendingHits | None = None
        if log_uses:
            self._hit_log = PendingHits(snapshot.location) if snapshot.remote else HitLog(snapshot.root)

    def switch(self, snapshot: StoreSnapshot) -> None:
        self.snapshot = snapshot

    def empty(self) -> Assembly:
        """No stored KV: the whole prompt is prefilled."""
        return Assembly(kv.to_cache_empty(self.lm.model.config))

    def load(
        self,
        rows: list[ContextRow],
        chunk_ids: list[tuple[int, ...]],
        settings: AskSettings,
        question_ids: Sequence[int] = (),
    ) -> Loaded:
        """The cache a prompt over `rows` (their token ids: `chunk_ids`; then `question_ids`,
        which the `query` mode selects by) starts from, per `settings.mode`: what the store
        holds of it, loaded and verified."""
        if not settings.use_cache:
            return Loaded(self.empty())
        loaded = Loaded(self.empty(), kv_quant=self.active.profile.kv_quant)
        if rows[0].live:  # nothing stored comes first: a full prefill (exact)
            return loaded
        runs = spans.runs(list(range(len(rows))), lambda i, j: continues_span(rows[i], rows[j]))
        refused = self._refusal(rows, runs, settings.mode)
        if refused:
            loaded.warnings.append(refused[0])
            loaded.fallback = refused[1]
            return loaded
        read_start = time.perf_counter()
        exact = settings.mode == "exact"
        # exact: entries are read when the cache is built, straight into it (codec.StoredKV)
        stored = self._load_stored([[rows[i] for i in run] for run in (runs[:1] if exact else runs)], loaded, exact)
        loaded.kv_read_ms = _ms(read_start)
        if stored is None:
            return loaded
        assemble_start = time.perf_counter()
        try:
            loaded.assembly = self._assemble_mode(stored, rows, runs, chunk_ids, settings, question_ids)
        except StoreCorruptError as exc:  # a deferred entry that failed as it was read
            self._fall_back(exc, loaded)
        deferred_ms = sum(part.read_ms for part in stored if isinstance(part, codec.StoredKV))
        loaded.assemble_ms = _ms(assemble_start) - deferred_ms
        loaded.kv_read_ms += deferred_ms
        return loaded

    def _refusal(self, rows: list[ContextRow], runs: list[list[int]], mode: str) -> tuple[str, bool] | None:
        """Why the prompt cannot start from stored KV in `mode` (and whether that is a
        fallback from an approximate mode), or None."""
        if mode != "exact" and any(row.live for row in rows):
            return (
                f"--mode {mode} composes stored KV; passages given as text have none, so the prompt was "
                "answered with a full prefill instead",
                True,
            )
        if not rows[runs[0][0]].starts_span:
            return (
                f"chunk {rows[0].chunk_index} of {rows[0].doc_id} continues a span: its KV holds the chunks "
                "before it, so it is prefilled live (ask with --context span)",
                False,
            )
        if mode != "exact" and not all(rows[run[0]].starts_span for run in runs):
            return (
                f"--mode {mode} needs every chunk's span from its start; answered with a full prefill instead "
                "(ask with --context span)",
                True,
            )
        return None

    def _assemble_mode(
        self,
        stored: list[kv.Part],
        rows: list[ContextRow],
        runs: list[list[int]],
        chunk_ids: list[tuple[int, ...]],
        settings: AskSettings,
        question_ids: Sequence[int],
    ) -> Assembly:
        """`stored`: the prefix KV, then one KV per loaded run (its chunks' entries joined)."""
        model = self.lm.model
        layout = self.active.layout
        if settings.mode == "exact":
            after = len(runs[0])
            segments = [(*layout.separator_ids, *ids) for ids in chunk_ids[after:]]
            last = rows[after - 1]
            root = (
                KVKey.from_string(last.entry.kv_key)
                if last.entry
                else KVKey.for_chunk(self.active.profile, chunk_ids[after - 1])
            )
            return assemble.exact(model, stored, segments, self.prefix_cache, root)
        prefix, pieces_kv = kv.whole(stored[0]), [kv.whole(part) for part in stored[1:]]
        pieces = [pieces_kv[0]]
        for piece in pieces_kv[1:]:
            pieces += [self._separator_kv(), piece]
        if settings.mode == "concat":
            return assemble.concat(model, prefix, pieces)
        if settings.mode == "ape":
            return assemble.ape(model, prefix, pieces, settings.ape_temperature, settings.ape_scale)
        context_ids = [*layout.prefix_ids, *layout.context_ids(chunk_ids)]
        ratio = settings.blend_ratio
        assert ratio is not None  # every recomputing mode has its share (AskSettings sets the default)
        if settings.mode == "epic":
            return assemble.epic(model, prefix, pieces, context_ids, ratio)
        if settings.mode == "query":
            return assemble.attended(model, prefix, pieces, context_ids, question_ids, ratio)
        return assemble.blended(model, prefix, pieces, context_ids, ratio)

    def _load_stored(self, runs: list[list[ContextRow]], loaded: Loaded, defer: bool) -> list[kv.Part] | None:
        """The prefix KV, then each run's parts (see `run_parts`), `(L, 2, H, T, D)` each, the
        stored ones left to be read into the cache when `defer`; None (with a warning) when any
        is missing or corrupt."""
        try:
            stored: list[kv.Part] = [self.prefix_kv()]
            for run in runs:
                parts = self.run_parts(run, loaded, len(loaded.kv_sources), defer)
                stored += parts if defer else [_joined([kv.whole(part) for part in parts])]
            return stored
        except StoreCorruptError as exc:
            self._fall_back(exc, loaded)
            return None

    @staticmethod
    def _fall_back(exc: StoreCorruptError, loaded: Loaded) -> None:
        message = f"{exc}; answered with a full prefill instead"
        log.warning(message)
        loaded.fallback = True
        loaded.warnings.append(message)

    def run_kv(self, run: Sequence[ContextRow], loaded: Loaded, slot: int = 0) -> torch.Tensor:
        """The KV of `run`, chunks that follow each other in one stored span (or one chunk):
        their entries joined along the tokens, `(L, 2, H, T_run, D)` (see `run_parts`)."""
        return _joined([kv.whole(part) for part in self.run_parts(run, loaded, slot)])

    def run_parts(self, run: Sequence[ContextRow], loaded: Loaded, slot: int = 0, defer: bool = False) -> list[kv.Part]:
        """The KV of `run`, chunks that follow each other in one stored span (or one chunk),
        `(L, 2, H, T_i, D)` per chunk, every entry's key checked against the tokens before it
        and its bytes verified; with `defer`, an entry read from the store may be left to be
        read straight into the cache (codec.StoredKV, verified then). What the store holds of
        the span is loaded; from the first chunk it has no KV for (a miss: the budget left it
        out), the rest is computed now in one forward after it, exactly in the span's own order,
        and written back. Read buffers from `slot` on are used. Raises StoreCorruptError when an
        entry does not verify."""
        if len(run) == 1 and run[0].entry is None and run[0].span_start is None:
            return [self._computed_kv(run[0], loaded)]  # a miss: compute it now
        chunk_ids = []
        for row in run:
            if row.token_ids is None:
                raise StoreCorruptError(f"chunk {row.chunk_id} has no stored KV for this model")
            chunk_ids.append(row.token_ids)
        keys = spans.span_keys(self.active.profile, chunk_ids, self.active.layout.separator_ids)
        parts: list[kv.Part] = []
        for i, (row, key) in enumerate(zip(run, keys, strict=True)):
            held = None if row.entry is not None else self._held(row, key.to_string(), loaded)
            if row.entry is None and held is None:
                parent = keys[i - 1].to_string() if i else None
                before = [kv.whole(part) for part in parts]
                parts += self._computed_span(run[i:], chunk_ids[i:], keys[i:], parent, before, loaded)
                break
            if held is not None:  # computed on an earlier miss, not stored (yet)
                parts.append(held)
                continue
            assert row.entry is not None
            if key.to_string() != row.entry.kv_key:
                raise StoreCorruptError(f"chunk {row.chunk_id}'s stored KV key does not match its tokens")
            hits = loaded.ram_hits
            parts.append(self._chunk_kv(row.entry, loaded, slot + i, defer))
            loaded.kv_sources[row.chunk_id] = "ram" if loaded.ram_hits > hits else "store"
        return parts

    def _computed_span(
        self,
        rows: Sequence[ContextRow],
        chunk_ids: Sequence[tuple[int, ...]],
        keys: Sequence[KVKey],
        parent: str | None,
        before: list[torch.Tensor],
        loaded: Loaded,
    ) -> list[torch.Tensor]:
        """The KV of a span's chunks `rows` (their ids `chunk_ids`, keyed `keys`) the store has
        none for, computed in one forward after the prefix and `before` (the span's chunks before
        them, `(L, 2, H, T_i, D)` each, the last keyed `parent`; a chunk stored alone is a span of
        one): one `(L, 2, H, T, D)` per row, passed through the store's codec (so it equals what a
        later store read returns). Each is kept in the RAM tier and handed to the background
        write-back, chained to the entry before it."""
        profile, separator = self.active.profile, self.active.layout.separator_ids
        segments = [
            spans.segment(0 if row.starts_span else 1, ids, separator) for row, ids in zip(rows, chunk_ids, strict=True)
        ]
        start = time.perf_counter()
        prefix = self.prefix_kv()
        base = torch.cat([prefix, *before], dim=kv.TOKEN_DIM) if before else prefix  # (L, 2, H, P + T_before, D)
        flat = [t for segment in segments for t in segment]
        (result,) = compute_chunks(self.lm.model, base, [flat], len(flat), self.lm.pad_id)
        computed = []
        pieces = split_segments(result.kv, [len(s) for s in segments])
        for row, ids, key, piece in zip(rows, chunk_ids, keys, pieces, strict=True):
            name = key.to_string()
            parts = codec.encode(piece, profile.kv_quant, kv.layout_of(self.lm.model.config).windows)
            kv_tensor = codec.decode({n: t.to(self.device) for n, t in parts.items()}, self.lm.model.dtype)
            self.ram.put(name, kv_tensor)
            loaded.kv_sources[row.chunk_id] = "computed"
            self._write_back(row, name, ids, parts, parent)
            computed.append(kv_tensor)
            parent = name
        loaded.kv_compute_ms += _ms(start)
        return computed

    def _chunk_kv(self, entry, loaded: Loaded, slot: int, defer: bool = False) -> kv.Part:
        """A chunk's KV from the RAM tier, else read (and verified) from its shard into read
        buffer `slot` (valid until the next request assembles), then kept in the RAM tier. With
        `defer`, when it can be: to be read straight into the cache, and kept in the RAM tier
        from there."""
        kv_tensor = self.ram.get(entry.kv_key)
        if kv_tensor is not None:
            loaded.ram_hits += 1
            return kv_tensor
        loaded.ram_misses += 1
        later = codec.deferred(self.snapshot.shards, entry, self.lm.model.dtype, self.device) if defer else None
        if later is not None:
            if later.nbytes <= self.ram.max_bytes:
                later.keep = lambda tensor: self.ram.put(entry.kv_key, tensor)
            return later
        buffer = self._read_buffer(slot, entry.nbytes + 64) if entry.nbytes else None  # + alignment of parts
        # The prefill that uses the KV runs after its copy on the same stream.
        kv_tensor = codec.read(self.snapshot.shards, entry, self.lm.model.dtype, self.device, out=buffer)
        if kv_tensor.numel() * kv_tensor.element_size() <= self.ram.max_bytes:
            kv_tensor = kv_tensor.clone() if kv_tensor.device.type == "cpu" else kv_tensor  # own memory
            self.ram.put(entry.kv_key, kv_tensor)
        return kv_tensor

    def _computed_kv(self, row: ContextRow, loaded: Loaded) -> torch.Tensor:
        """The KV of a chunk stored alone the store has none for, `(L, 2, H, T, D)`: from the RAM
        tier if computed earlier, else computed now after the prefix, exactly as ingest would
        (see `_computed_span`)."""
        token_ids = row.token_ids if row.token_ids is not None else self._text_ids(row)
        key = KVKey.for_chunk(self.active.profile, token_ids)
        held = self._held(row, key.to_string(), loaded)
        if held is not None:
            return held
        return self._computed_span([row], [token_ids], [key], None, [], loaded)[0]

    def _held(self, row: ContextRow, key: str, loaded: Loaded) -> torch.Tensor | None:
        """KV the store has no entry for that is ready all the same: computed on an earlier
        miss (the RAM tier), or, on S3, by another replica that left it pending for the fold
        (read from the bucket, verified, counted as a store hit)."""
        kv_tensor = self.ram.get(key)
        if kv_tensor is not None:
            loaded.ram_hits += 1
            loaded.kv_sources[row.chunk_id] = "ram"
            return kv_tensor
        parts = self.fleet.find(key) if self.fleet is not None else None
        if parts is None:
            return None
        kv_tensor = codec.decode({n: t.to(self.device) for n, t in parts.items()}, self.lm.model.dtype)
        self.ram.put(key, kv_tensor)
        loaded.kv_sources[row.chunk_id] = "store"
        return kv_tensor

    def _write_back(
        self, row: ContextRow, key: str, token_ids: tuple[int, ...], parts: dict[str, torch.Tensor], parent: str | None
    ) -> None:
        """Hand KV computed on a miss (encoded `parts`) to the background write-back, if on."""
        writer = self._background_writer()
        if writer is None:
            return
        profile = self.active.profile
        metadata = shard_metadata(
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
            location = self.snapshot.location if self.snapshot.remote else self.snapshot.root
            self.writer = WriteBack(location, self.pending_bytes, self.leave_pending)
        return self.writer

    def hot(self) -> dict:
        """What the RAM tier holds, for a router that sends a document's questions where its KV
        is warm: the count, bytes and counters, and each chunk whose KV is held (its id,
        document and key; a key of identical text may serve several chunks). `computed`: KV
        held for chunks the store has none for yet (computed on a miss, not yet written back).
        Reads the catalog: call it where the engine's steps run."""
        keys = [str(key) for key in self.ram.keys()]
        linked = self.snapshot.catalog.entries.chunks_of_keys(self.active.profile.profile_id, keys)
        return {
            "generation": self.snapshot.generation,
            "profile_id": self.active.profile.profile_id,
            **self.ram.stats(),
            "chunks": [{"chunk_id": c, "doc_id": d, "kv_key": k} for k, c, d in linked],
            "documents": sorted({d for _, _, d in linked}),
            "computed": len(set(keys) - {k for k, _, _ in linked}),
        }

    def pending_uploaded(self) -> int:
        """Bytes this reader left pending for the writer's fold (S3): computed KV and uses."""
        kv = self.writer.pending.report.bytes if self.writer and self.writer.pending else 0
        return kv + (self._hit_log.bytes if isinstance(self._hit_log, PendingHits) else 0)

    def pending_dropped(self) -> int:
        """Computed KV entries this reader dropped to stay within its pending bound (S3)."""
        return self.writer.pending.report.dropped_entries if self.writer and self.writer.pending else 0

    def record_uses(self, rows: Iterable[ContextRow], kv_sources: dict[int, str]) -> None:
        """Log each chunk a prompt used, with where its KV came from (popularity, hit rate)."""
        self._log_uses([Use(r.doc_id, r.chunk_index, kv_sources.get(r.chunk_id, "live")) for r in rows if not r.live])

    def _log_uses(self, uses: list[Use]) -> None:
        """Log `uses` (none: leave what is buffered, on S3), or stop counting if that fails."""
        if self._hit_log is None:
            return
        try:
            if uses:
                self._hit_log.record(uses)
            else:
                self._hit_log.flush()
        except OSError as exc:  # a read-only store still answers; it only stops counting
            log.warning(
                "cannot log chunk uses in %s (%s); popularity is not counted for this engine",
                self.snapshot.location,
                exc.strerror or exc,
            )
            self._hit_log = None

    def _read_buffer(self, slot: int, size: int) -> torch.Tensor:
        """Reused host memory to read stored KV into: one buffer per chunk of a request,
        page-locked when the model is on a GPU (so the host-to-device copy can overlap)."""
        while len(self._read_buffers) <= slot:
            self._read_buffers.append(torch.empty(0, dtype=torch.uint8))
        if self._read_buffers[slot].numel() < size:
            pinned = torch.device(self.device).type == "cuda"
            self._read_buffers[slot] = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
        return self._read_buffers[slot]

    def prefix_kv(self) -> torch.Tensor:
        """The system-prompt KV `(L, 2, H, P, D)`, read once and kept."""
        if self._prefix_kv is None:
            entry = self.snapshot.catalog.entries.entry(KVKey.for_prefix(self.active.profile).to_string())
            if entry is None:
                raise StoreCorruptError("the system-prompt KV is missing from the store")
            self._prefix_kv = codec.read(self.snapshot.shards, entry, self.lm.model.dtype, self.device)
        return self._prefix_kv

    def _separator_kv(self) -> torch.Tensor:
        """KV of the chunk separator computed right after the prefix, like a stored chunk."""
        if self._separator is None:
            separator = list(self.active.layout.separator_ids)
            (result,) = compute_chunks(self.lm.model, self.prefix_kv(), [separator], len(separator), self.lm.pad_id)
            self._separator = result.kv.to(self.device)
        return self._separator

    def flush(self) -> None:
        """Wait until KV computed on misses so far is written to the store (or given up), and
        leave the uses logged so far where the writer folds them."""
        if self.writer is not None:
            self.writer.flush()
        self._log_uses([])

    def close(self) -> None:
        """Finish the write-back and the use log."""
        if self.writer is not None:
            self.writer.close()
        self._log_uses([])
        if self._hit_log is not None:
            self._hit_log.close()


def continues_span(previous: ContextRow, row: ContextRow) -> bool:
    """Whether `row` is the chunk right after `previous` in the same stored span (so their KV
    loads as one sequence)."""
    return (
        not row.starts_span
        and row.span_start is not None
        and previous.doc_id == row.doc_id
        and previous.span_start == row.span_start
        and row.chunk_index == previous.chunk_index + 1
    )


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=kv.TOKEN_DIM)


def _ms(since: float) -> float:
    return (time.perf_counter() - since) * 1000.0
