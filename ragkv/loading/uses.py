"""Which chunks prompts used, and where each one's KV came from: the popularity the budget keeps
KV by, and the hit rate. Appended to the store's hit log, or on S3 (where a reader never writes
the store) left under pending/ for the writer's fold."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from ragkv.store import ContextRow, StoreSnapshot
from ragkv.store.kv.pending_hits import PendingHits
from ragkv.store.kv.popularity import HitLog, Use

log = logging.getLogger("ragkv")


class UseLog:
    """The uses of one engine's prompts (ragkv's own, or vLLM's through the connector), written to
    `log`; a store that cannot be written stops the counting, never an answer."""

    def __init__(self, log: HitLog | PendingHits, location: str, who: str = "this engine"):
        self.location = location
        self.who = who  # named in the warning when counting stops
        self._log: HitLog | PendingHits | None = log

    @classmethod
    def of(cls, snapshot: StoreSnapshot) -> UseLog:
        """The use log a reader of `snapshot` writes (where, the snapshot says)."""
        return cls(snapshot.use_log(), snapshot.location)

    def record(self, rows: Iterable[ContextRow], kv_sources: dict[int, str]) -> None:
        """Log each chunk a prompt used, with where its KV came from."""
        self.write([Use(r.doc_id, r.chunk_index, kv_sources.get(r.chunk_id, "live")) for r in rows if not r.live])

    def pending_bytes(self) -> int:
        """Bytes of uses left pending for the writer's fold (S3)."""
        return self._log.bytes if isinstance(self._log, PendingHits) else 0

    def flush(self) -> None:
        """Leave the uses logged so far where the writer folds them."""
        self.write([])

    def close(self) -> None:
        self.write([])
        if self._log is not None:
            self._log.close()

    def write(self, uses: list[Use]) -> None:
        """Log `uses` (none: leave what is buffered, on S3), or stop counting if that fails."""
        if self._log is None:
            return
        try:
            if uses:
                self._log.record(uses)
            else:
                self._log.flush()
        except OSError as exc:  # a read-only store still answers; it only stops counting
            log.warning(
                "cannot log chunk uses in %s (%s); popularity is not counted for %s",
                self.location,
                exc.strerror or exc,
                self.who,
            )
            self._log = None
