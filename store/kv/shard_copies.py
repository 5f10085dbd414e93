"""An S3 store's shards as a reader on this machine sees them: a first read of a shard goes to
the bucket by ranged GETs while the whole shard is copied into the mirror in the background,
so later reads are local; copies beyond the cache bound are evicted least recently used."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ragkv.core.errors import StoreCorruptError
from ragkv.store.kv.shards import SHARD_SUFFIX
from ragkv.store.objects import Location, read_error

log = logging.getLogger("ragkv")

_FRESH_S = 120  # a shard written or read this recently is never evicted
_STALE_TMP_S = 3600  # a partial copy this old belongs to no live process


class ShardCopies:
    """An S3 store's `remote.copies`: its shards copied into `folder` (a shard reader's
    `RemoteShards`, see ragkv.store.kv.shard_files), at most `cache_bytes` of them. `fs` reads
    the bucket at `location`; `download(name, path)` copies one object atomically."""

    def __init__(self, folder: Path, location: Location, fs, download: Callable[[str, Path], None], cache_bytes: int):
        self.folder, self.location, self.fs = folder, location, fs
        self.download = download
        self.cache_bytes = cache_bytes
        self._fetching: dict[str, threading.Thread] = {}  # shard -> its background copy
        self._fetching_lock = threading.Lock()

    def local(self, shard: str) -> Path | None:
        """The local copy, if there is one (marked recently used: evicted last)."""
        path = self.folder / shard
        try:
            os.utime(path)
        except FileNotFoundError:
            return None
        return path

    def open(self, shard: str):
        """A random-access file on the bucket's shard; starts copying it down for later reads."""
        try:
            handle = self.fs.open_input_file(self.location.key("shards", shard))
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise read_error(self.location.uri, exc) from exc
        self._prefetch(shard)
        return handle

    def fetch(self, name: str) -> Path:
        """The local copy of a shard, downloaded if missing; keeps the copies within their bound."""
        path = self.folder / name
        if path.exists():
            os.utime(path)
            return path
        try:
            self.download(f"shards/{name}", path)
        except FileNotFoundError:
            raise StoreCorruptError(f"shard {name} is missing from {self.location.uri}") from None
        except OSError as exc:
            raise read_error(self.location.uri, exc) from exc
        self.evict(keep=name)
        return path

    def evict(self, keep: str = "") -> int:
        """Delete least-recently-used copies beyond the bound. Returns bytes freed."""
        files = []
        for path in self.folder.glob(f"*{SHARD_SUFFIX}"):
            try:
                stat = path.stat()
            except FileNotFoundError:
                continue
            files.append((stat.st_mtime, stat.st_size, path))
        total, freed, now = sum(size for _, size, _ in files), 0, time.time()
        for tmp in self.folder.glob(".*.tmp"):  # copies cut short by a process exit
            try:
                if now - tmp.stat().st_mtime > _STALE_TMP_S:
                    tmp.unlink()
            except FileNotFoundError:
                pass
        for mtime, size, path in sorted(files):
            if total - freed <= self.cache_bytes:
                break
            if path.name != keep and now - mtime > _FRESH_S:
                path.unlink(missing_ok=True)  # open readers keep their descriptor
                freed += size
        return freed

    def _prefetch(self, shard: str) -> None:
        with self._fetching_lock:
            if shard in self._fetching:
                return
            self._fetching[shard] = thread = threading.Thread(
                target=self._fetch_quietly, args=(shard,), daemon=True, name=f"ragkv-fetch-{shard[:8]}"
            )
        thread.start()

    def _fetch_quietly(self, shard: str) -> None:
        try:
            self.fetch(shard)
        except Exception as exc:  # reads go on from the bucket; the next open tries again
            log.warning("could not copy shard %s from %s: %s", shard, self.location.uri, exc)
        finally:
            with self._fetching_lock:
                self._fetching.pop(shard, None)
