"""Which chunks questions use: a hit log every reader appends to, folded into the catalog by
the writer, and the popularity score a KV budget keeps chunks by.

    hits/<host>-<pid>-<rand>.jsonl   one file per reading process, appended one line per use:
                                     {"t": epoch seconds, "doc": doc_id, "i": chunk_index, "src": source}

Readers never take the store's write lock to count a use: each appends to its own file and
holds a shared flock on it while open. The next writer (ingest, a write-back, `ragkv budget`)
folds the lines past the offset it last folded into the catalog's `chunk_hits`, and deletes
the files whose reader is gone once they are folded in full. Counts therefore survive
restarts, and a writer never waits for a reader.

Popularity is keyed by (document, chunk index), not chunk id, so a changed document's chunks
inherit what its old chunks earned: the nightly job recomputes the hot ones first.

The score is LFU with ageing: each use adds 1, and the score halves every `half_life_s`
seconds without uses (default 7 days). Pure LFU keeps yesterday's hot chunks forever once
traffic moves; pure LRU forgets a chunk asked every day behind a burst of one-off questions.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

HITS_DIR = "hits"
HALF_LIFE_S = 7 * 86400.0
SOURCES = ("store", "ram", "computed", "live")  # where a used chunk's KV came from ("live": prefilled, no KV)
HIT_SOURCES = ("store", "ram")  # uses that found KV ready (a hit); "computed" is a miss


@dataclass(frozen=True)
class Use:
    """One retrieved chunk used by one question."""

    doc_id: str
    chunk_index: int
    source: str  # one of SOURCES
    time: float = 0.0  # epoch seconds; 0: now


def decay(score: float, since: float, now: float, half_life_s: float) -> float:
    """`score` as it stands `now`, earned at `since`: halved every `half_life_s` seconds."""
    return score * 0.5 ** (max(now - since, 0.0) / half_life_s)


def use_line(use: Use, now: float) -> str:
    """`use` as one log line (stamped `now` if it has no time)."""
    return json.dumps({"t": use.time or now, "doc": use.doc_id, "i": use.chunk_index, "src": use.source}) + "\n"


class HitLog:
    """This process's append-only use log in `root/hits/` (created on the first use)."""

    def __init__(self, root: Path):
        self.dir = Path(root) / HITS_DIR
        self._fd: int | None = None

    def record(self, uses: Iterable[Use]) -> None:
        """Append `uses` (one write: lines of one call are never interleaved with another's)."""
        now = time.time()
        lines = "".join(use_line(u, now) for u in uses)
        if not lines:
            return
        if self._fd is None:
            self._fd = self._open()
        os.write(self._fd, lines.encode())

    def _open(self) -> int:
        self.dir.mkdir(exist_ok=True)
        path = self.dir / f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}.jsonl"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        fcntl.flock(fd, fcntl.LOCK_SH)  # held while open: the writer deletes the file only after folding it
        return fd

    def flush(self) -> None:
        """Nothing to do: each `record` is written at once."""

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


@dataclass(frozen=True)
class Pending:
    """Uses logged since the catalog last folded them: per file, the lines and the new offset."""

    uses: list[Use]
    offsets: dict[str, int]  # file name -> bytes folded once these are
    finished: list[str]  # files whose reader is gone and that the catalog had folded in full
    unusable: dict[str, int] = field(default_factory=dict)  # file name -> lines (or unreadable files) skipped


MAX_READ_BYTES = 64 << 20  # read per file per fold; the rest waits for the next writer (bounded work)
MAX_CHUNK_INDEX = 2**31 - 1  # the catalog keeps chunk indexes as int32
MAX_CLOCK_SKEW_S = 86400.0  # a use stamped further in the future than this is not believed


def read_pending(root: Path, folded: dict[str, int]) -> Pending:
    """The uses in `root/hits/` past the offsets already `folded` (whole lines only). A line
    that is not a use (torn by a killed reader, or written by anything else) is skipped and
    counted in `unusable`: a log can never stop a writer."""
    hits_dir = Path(root) / HITS_DIR
    pending = Pending([], {}, [])
    if not hits_dir.is_dir():
        return pending
    now = time.time()
    for path in sorted(hits_dir.glob("*.jsonl")):
        start = folded.get(path.name, 0)
        try:
            with open(path, "rb") as f:
                is_gone = _reader_gone(f.fileno())
                f.seek(start)
                data = f.read(MAX_READ_BYTES)
        except FileNotFoundError:
            continue
        except OSError:  # not a readable file (a folder of that name, no permission): nothing to fold
            pending.unusable[path.name] = pending.unusable.get(path.name, 0) + 1
            continue
        end = data.rfind(b"\n") + 1  # a line still being written is folded next time
        if not end and len(data) == MAX_READ_BYTES:  # one endless line, nothing a reader writes: skip it
            end = len(data)
        for line in data[:end].splitlines():
            use = parse_use(line, now)
            if use is None:
                pending.unusable[path.name] = pending.unusable.get(path.name, 0) + 1
            else:
                pending.uses.append(use)
        pending.offsets[path.name] = start + end
        if is_gone and not data:  # folded in full by a published generation, and nobody appends
            pending.finished.append(path.name)
    return pending


def parse_use(line: bytes, now: float) -> Use | None:
    """The use one log line records, or None if it is not one (any JSON, or none at all)."""
    try:
        row = json.loads(line)
        doc, index, source, when = row["doc"], row["i"], row["src"], row["t"]
    except Exception:  # not JSON, not an object, a field missing
        return None
    if not (
        isinstance(doc, str)
        and 0 < len(doc) <= 4096
        and isinstance(index, int)
        and not isinstance(index, bool)
        and 0 <= index <= MAX_CHUNK_INDEX
        and source in SOURCES
        and isinstance(when, (int, float))
        and not isinstance(when, bool)
        and 0 < when <= now + MAX_CLOCK_SKEW_S
    ):  # NaN fails the comparison
        return None
    return Use(doc, index, source, float(when))


def _reader_gone(fd: int) -> bool:
    """Whether no process holds the file's shared lock (its reader closed or died)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    fcntl.flock(fd, fcntl.LOCK_UN)
    return True


def remove_finished(root: Path, names: Iterable[str]) -> None:
    for name in names:
        (Path(root) / HITS_DIR / name).unlink(missing_ok=True)


@dataclass
class ChunkHits:
    """A chunk's popularity row: uses that found KV (hits), that computed it (misses), and
    its ageing score as of `last_use`."""

    hits: int = 0
    misses: int = 0
    uses: int = 0
    score: float = 0.0
    last_use: float = 0.0

    def add(self, use: Use, half_life_s: float) -> None:
        self.score = decay(self.score, self.last_use, use.time, half_life_s) + 1.0 if self.uses else 1.0
        self.last_use = max(self.last_use, use.time)
        self.uses += 1
        self.hits += use.source in HIT_SOURCES
        self.misses += use.source == "computed"


def tally(rows: dict[tuple[str, int], ChunkHits], uses: Iterable[Use], half_life_s: float) -> set[tuple[str, int]]:
    """Add `uses` (in time order) to `rows`, creating rows as needed; returns the keys changed."""
    changed = set()
    for use in sorted(uses, key=lambda u: u.time):
        key = (use.doc_id, use.chunk_index)
        rows.setdefault(key, ChunkHits()).add(use, half_life_s)
        changed.add(key)
    return changed
