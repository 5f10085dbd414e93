"""The cache a prompt starts from, per `--mode` (see ragkv.modes.assemble): the prompt's stored KV
read and verified (`reader`), what the store lacks computed and written back (`misses`), the
uses logged (`uses`), assembled."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Sequence

from ragkv.core.config import AskSettings
from ragkv.core.errors import StoreCorruptError
from ragkv.core.keys import KVKey
from ragkv.core.lru import ByteLRU
from ragkv.core.scope import cache_salt
from ragkv.kv import cache as kv
from ragkv.kv import codec, spans
from ragkv.kv.entry import Entry, joined
from ragkv.loading.misses import Misses
from ragkv.loading.reader import Loaded, StoredReads, ms_since
from ragkv.loading.uses import UseLog
from ragkv.model.forward import compute_chunks
from ragkv.model.llm import LoadedModel
from ragkv.model.profiles import ActiveProfile
from ragkv.modes import assemble
from ragkv.modes.assemble import Assembly
from ragkv.modes.prefix_cache import PrefixCache, salted
from ragkv.store import ContextRow, StoreSnapshot
from ragkv.store.kv.writeback import PENDING_BYTES, WriteBack

__all__ = ["KVLoader", "Loaded", "continues_span"]

log = logging.getLogger("ragkv")


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
        isolate_tenants: bool = False,
    ):
        self.lm = lm
        self.isolate_tenants = isolate_tenants  # the RAM tier keyed by tenant too (see `tenant`)
        self.active = active
        self.prefix_cache = PrefixCache(prefix_cache_bytes)
        self.reads = StoredReads(snapshot, lm, active, device, ram_bytes)
        self.misses = Misses(self.reads, write_back, pending_bytes, leave_pending)
        self.uses = UseLog.of(snapshot) if log_uses else None
        self._separator: Entry | None = None

    @property
    def ram(self) -> ByteLRU[Entry]:
        """The RAM tier: hot chunk entries by key, verified when loaded."""
        return self.reads.ram

    @ram.setter
    def ram(self, tier: ByteLRU[Entry]) -> None:
        self.reads.ram = tier

    @property
    def writer(self) -> WriteBack | None:
        """The background write-back, once a miss started it."""
        return self.misses.writer

    @contextlib.contextmanager
    def tenant(self, salt: str):
        """Within this block the RAM tier serves `salt`'s (a tenant's) own entries, when tenants
        are isolated: no tenant then hits stored KV another read, or a miss another computed."""
        if not self.isolate_tenants:
            yield
            return
        self.reads.salt = salt
        try:
            yield
        finally:
            self.reads.salt = ""

    def switch(self, snapshot: StoreSnapshot) -> None:
        self.reads.snapshot = snapshot

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
        loaded.kv_read_ms = ms_since(read_start)
        if stored is None:
            return loaded
        assemble_start = time.perf_counter()
        try:
            loaded.assembly = self._assemble_mode(stored, rows, runs, chunk_ids, settings, question_ids)
        except StoreCorruptError as exc:  # a deferred entry that failed as it was read
            self._fall_back(exc, loaded)
        deferred_ms = sum(part.read_ms for part in stored if isinstance(part, codec.StoredKV))
        loaded.assemble_ms = ms_since(assemble_start) - deferred_ms
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
            salted_root = salted(root, cache_salt(settings.scope))
            return assemble.exact(model, stored, segments, self.prefix_cache, salted_root, question_ids[:-1])
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
        """The prefix entry, then each run's parts (see `run_parts`), the stored ones left to be
        read into the cache when `defer`; None (with a warning) when any is missing or corrupt."""
        try:
            stored: list[kv.Part] = [self.reads.prefix()]
            for run in runs:
                parts = self.run_parts(run, loaded, len(loaded.kv_sources), defer)
                stored += parts if defer else [joined([kv.whole(part) for part in parts])]
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

    def run_kv(self, run: Sequence[ContextRow], loaded: Loaded, slot: int = 0) -> Entry:
        """The entry of `run`, chunks that follow each other in one stored span (or one chunk):
        their entries joined along the tokens, with the last one's state (see `run_parts`)."""
        return joined([kv.whole(part) for part in self.run_parts(run, loaded, slot)])

    def run_parts(self, run: Sequence[ContextRow], loaded: Loaded, slot: int = 0, defer: bool = False) -> list[kv.Part]:
        """The entries of `run`, chunks that follow each other in one stored span (or one chunk),
        one per chunk, every entry's key checked against the tokens before it
        and its bytes verified; with `defer`, an entry read from the store may be left to be
        read straight into the cache (codec.StoredKV, verified then). What the store holds of
        the span is loaded; from the first chunk it has no KV for (a miss: the budget left it
        out), the rest is computed now in one forward after it, exactly in the span's own order,
        and written back. Read buffers from `slot` on are used. Raises StoreCorruptError when an
        entry does not verify."""
        if len(run) == 1 and run[0].entry is None and run[0].span_start is None:
            return [self.misses.chunk(run[0], loaded)]  # a miss: compute it now
        chunk_ids = []
        for row in run:
            if row.token_ids is None:
                raise StoreCorruptError(f"chunk {row.chunk_id} has no stored KV for this model")
            chunk_ids.append(row.token_ids)
        keys = spans.span_keys(self.active.profile, chunk_ids, self.active.layout.separator_ids)
        parts: list[kv.Part] = []
        for i, (row, key) in enumerate(zip(run, keys, strict=True)):
            held = None if row.entry is not None else self.misses.held(row, key.to_string(), loaded)
            if row.entry is None and held is None:
                parent = keys[i - 1].to_string() if i else None
                before = [kv.whole(part) for part in parts]
                parts += self.misses.span(run[i:], chunk_ids[i:], keys[i:], parent, before, loaded)
                break
            if held is not None:  # computed on an earlier miss, not stored (yet)
                parts.append(held)
                continue
            assert row.entry is not None
            if key.to_string() != row.entry.kv_key:
                raise StoreCorruptError(f"chunk {row.chunk_id}'s stored KV key does not match its tokens")
            hits = loaded.ram_hits
            parts.append(self.reads.chunk(row.entry, loaded, slot + i, defer))
            loaded.kv_sources[row.chunk_id] = "ram" if loaded.ram_hits > hits else "store"
        return parts

    def hot(self) -> dict:
        """What the RAM tier holds (see `StoredReads.hot`)."""
        return self.reads.hot()

    def pending_uploaded(self) -> int:
        """Bytes this reader left pending for the writer's fold (S3): computed KV and uses."""
        return self.misses.pending_uploaded() + (self.uses.pending_bytes() if self.uses else 0)

    def written_back(self) -> int:
        """Entries of KV computed on a miss that the write-back stored so far (see `misses`)."""
        return self.misses.written_back()

    def pending_dropped(self) -> int:
        """Computed KV entries this reader dropped to stay within its pending bound (S3)."""
        return self.misses.pending_dropped()

    def record_uses(self, rows: Iterable[ContextRow], kv_sources: dict[int, str]) -> None:
        """Log each chunk a prompt used, with where its KV came from (popularity, hit rate)."""
        if self.uses is not None:
            self.uses.record(rows, kv_sources)

    def prefix_kv(self) -> Entry:
        """The system-prompt entry, read once and kept."""
        return self.reads.prefix()

    def _separator_kv(self) -> Entry:
        """KV of the chunk separator computed right after the prefix, like a stored chunk."""
        if self._separator is None:
            separator = list(self.active.layout.separator_ids)
            (result,) = compute_chunks(self.lm.model, self.reads.prefix(), [separator], len(separator), self.lm.pad_id)
            self._separator = result.kv.to(self.reads.device)
        return self._separator

    def flush(self) -> None:
        """Wait until KV computed on misses so far is written to the store (or given up), and
        leave the uses logged so far where the writer folds them."""
        self.misses.flush()
        if self.uses is not None:
            self.uses.flush()

    def close(self) -> None:
        """Finish the write-back and the use log."""
        self.misses.close()
        if self.uses is not None:
            self.uses.close()


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
