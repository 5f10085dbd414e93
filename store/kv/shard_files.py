"""The files a shard reader reads entries from: a local file (`pread`, into the caller's buffer), or
a shard on S3 read by ranged GETs (a cold read fetches only the entry's bytes), through
`RemoteShards` (an S3 store's `copies`: ragkv.store.kv.shard_copies), which also copies the shard
down for later reads."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol


class RemoteShards(Protocol):
    """Where shards missing from a reader's folder come from (an S3 store, see store.remote)."""

    def local(self, shard: str) -> Path | None:
        """The local copy, if there is one (marking it recently used)."""

    def open(self, shard: str):
        """A random-access file (pyarrow's: `read_at(nbytes, offset)`, `close()`) on the remote
        shard; also starts copying it down in the background for later reads."""


class LocalFile:
    def __init__(self, path: Path):
        self.fd = os.open(path, os.O_RDONLY)

    def read(self, size: int, offset: int) -> bytes:
        return os.pread(self.fd, size, offset)

    def read_into(self, view: memoryview, offset: int) -> int:
        return os.preadv(self.fd, [view], offset)

    def close(self) -> None:
        os.close(self.fd)


class RemoteFile:
    """Ranged GETs: a cold read fetches only the entry's bytes, not the whole shard."""

    def __init__(self, handle):
        self.handle = handle

    def read(self, size: int, offset: int) -> bytes:
        return self.handle.read_at(size, offset)

    def read_into(self, view: memoryview, offset: int) -> int:
        view = view.cast("B") if view.ndim != 1 or view.format != "B" else view  # bytes, one dimension
        data = self.handle.read_at(len(view), offset)
        view[: len(data)] = data
        return len(data)

    def close(self) -> None:
        self.handle.close()
