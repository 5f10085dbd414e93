"""Published generations: a store's catalog and vector index are replaced together, atomically.

    CURRENT                 the published generation number (written aside, fsynced, renamed)
    catalog-000007.duckdb   that generation's catalog (checkpointed, closed, never reopened for writing)
    vectors-000007.faiss    that generation's FAISS index
    shards/                 KV shards shared by all generations
    LOCK                    held (flock) by the one writer, with its pid

A writer builds generation g+1 from copies of g, then publishes it by renaming CURRENT.
Readers open whatever CURRENT names, so they see generation g or g+1 in full, never a mix,
and never contend with the writer's DuckDB lock.
"""

from __future__ import annotations

import fcntl
import os
import re
from pathlib import Path

from ragkv.errors import StoreLockedError
from store.shards import fsync_dir

CURRENT = "CURRENT"
LOCK = "LOCK"
_GENERATION_FILE = re.compile(r"^(catalog|vectors)-(\d{6})\.(duckdb|faiss)(\.partial)?(\.wal)?$")


def catalog_path(root: Path, generation: int) -> Path:
    return root / f"catalog-{generation:06d}.duckdb"


def vectors_path(root: Path, generation: int) -> Path:
    return root / f"vectors-{generation:06d}.faiss"


def read_current(root: Path) -> int | None:
    """The published generation, or None if nothing was ever published."""
    try:
        return int((root / CURRENT).read_text().strip())
    except FileNotFoundError:
        return None


def publish(root: Path, generation: int) -> None:
    """Make `generation` current, atomically and durably."""
    tmp = root / f".{CURRENT}.tmp"
    with open(tmp, "w") as f:
        f.write(f"{generation}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / CURRENT)
    fsync_dir(root)


def is_store_file(name: str) -> bool:
    """A name a store writer creates at the top of a store."""
    return name in (CURRENT, LOCK, f".{CURRENT}.tmp") or bool(_GENERATION_FILE.match(name))


def remove_generations(root: Path, keep: set[int]) -> None:
    """Delete generation files (published or partial) whose number is not in `keep`."""
    for path in root.iterdir():
        match = _GENERATION_FILE.match(path.name)
        if match and int(match.group(2)) not in keep:
            path.unlink(missing_ok=True)


class WriteLock:
    """An exclusive flock on `root/LOCK`, holding the writer's pid for the error message."""

    def __init__(self, root: Path, wait: bool):
        self.path = root / LOCK
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            holder = os.pread(self._fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(self._fd)
            raise StoreLockedError(
                f"store {root} is being written by another process (pid {holder}); "
                "wait for it to finish, or pass --wait to queue behind it"
            ) from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
