"""The chunk uses a reader of a shared store (S3) logs: buffered, and left under pending/ as hits
objects for the one writer's fold, which reads them back (`read_hits`) with the uses a folder
store's readers append to its hit log (ragkv.store.kv.popularity)."""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections.abc import Iterable
from pathlib import Path

from ragkv.store.kv.pending import HITS_SUFFIX, PendingArea, new_object_id
from ragkv.store.kv.popularity import Pending, Use, parse_use, use_line

log = logging.getLogger("ragkv")

_AT_EXIT: weakref.WeakSet[PendingHits] = weakref.WeakSet()  # flushed when the process exits
HITS_FLUSH_S = 10.0  # a reader leaves its buffered uses this long after the first of them


class PendingHits:
    """The uses a reader of a store it does not write logs: buffered, and left as one hits
    object `flush_s` seconds after the first use buffered (a timer: an idle replica's last
    uses are not held back), on `flush` and on `close` (the interface of ragkv.store.kv.popularity's
    HitLog). A failed upload raises from `flush`; from the timer it is logged once."""

    def __init__(self, location: str | Path, flush_s: float = HITS_FLUSH_S):
        self.area = PendingArea(location)
        _flush_at_exit(self)  # after the area: S3's client exists, and is finalised after this flush
        self.flush_s = flush_s
        self.objects = 0  # hits objects left
        self.bytes = 0  # their bytes
        self._lines: list[str] = []
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._warned = False

    def record(self, uses: Iterable[Use]) -> None:
        now = time.time()
        lines = [use_line(u, now) for u in uses]
        with self._lock:
            self._lines += lines
            if self._lines and self._timer is None:
                self._timer = threading.Timer(self.flush_s, self._flush_quietly)
                self._timer.daemon = True
                self._timer.start()

    def flush(self) -> None:
        """Leave the buffered uses as one object (none buffered: nothing)."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            data, self._lines = "".join(self._lines).encode(), []
        if data:
            self.area.put_bytes(f"{new_object_id()}{HITS_SUFFIX}", data)
            self.objects += 1
            self.bytes += len(data)

    def _flush_quietly(self) -> None:
        try:
            self.flush()
        except OSError as exc:  # the lines are lost; counting goes on with the next ones
            if not self._warned:
                self._warned = True
                log.warning("cannot leave chunk uses in %s: %s", self.area.dir, exc)

    def close(self) -> None:
        self.flush()


def _flush_at_exit(hits: PendingHits) -> None:
    """Leave `hits`' buffered uses when the process exits. The hook is registered with the
    first one, after its area exists: exit hooks run last-registered first, and pyarrow's S3
    registers its finaliser when first imported, which must run after this flush."""
    if not _AT_EXIT:
        atexit.unregister(_flush_all)  # once, however many readers came and went
        atexit.register(_flush_all)
    _AT_EXIT.add(hits)


def _flush_all() -> None:
    for hits in list(_AT_EXIT):
        hits._flush_quietly()


def read_hits(area: PendingArea, folded: dict[str, int], names: dict[str, int] | None = None) -> Pending:
    """The uses in the hits objects under `area` (listed as `names`, else listed here) past
    the sizes already `folded` (an object folded by a fold that published but did not get to
    delete it counts nothing again); `finished`: folded objects that are gone, whose offsets
    the catalog can forget."""
    names = area.names() if names is None else names
    found = Pending([], {}, [n for n in folded if n.endswith(HITS_SUFFIX) and n not in names])
    now = time.time()
    for name in sorted(n for n in names if n.endswith(HITS_SUFFIX)):
        start = folded.get(name, 0)
        data = area.read_bytes(name) if names[name] > start else b""
        if data is None:
            continue
        for line in data[start:].splitlines():
            use = parse_use(line, now)
            if use is None:
                found.unusable[name] = found.unusable.get(name, 0) + 1
            else:
                found.uses.append(use)
        found.offsets[name] = max(start, len(data))
    return found
