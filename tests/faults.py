"""Fault injection the tests install (never shipped in the library's code paths): each helper
patches one seam of the process it runs in."""

from __future__ import annotations

import os
import signal
import threading


def kill_after_sealing_a_shard(not_before: threading.Event | None = None) -> None:
    """SIGKILL this process as soon as a shard writer seals a shard and before anything commits
    catalog rows for it: the moment "data before index" must survive. `not_before`: a
    background write-back waits for it before the kill (set it once the main thread has said
    what the test reads, which the write-back would otherwise race)."""
    from ragkv.store.kv.shards import ShardWriter

    original = ShardWriter.flush

    def flush_then_die(self):
        sealed = original(self)
        if sealed:
            if not_before is not None:
                not_before.wait()
            os.kill(os.getpid(), signal.SIGKILL)
        return sealed

    ShardWriter.flush = flush_then_die


def kill_once(marker: str):
    """A `WorkerSpec.after_seal` hook: the first worker to seal a shard SIGKILLs itself (before it
    reports the shard), exactly once across processes (whoever creates `marker`). Defined here
    and pickled by value, so a Ray worker runs it without importing the tests."""

    def after_seal(sealed) -> None:
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
        os.kill(os.getpid(), signal.SIGKILL)

    return after_seal


def kill_mid_compaction() -> None:
    """SIGKILL this process in the middle of a catalog compaction: once the new base holds its
    chunks but before the rest of its tables (and long before anything publishes it)."""
    from ragkv.store.catalog.overlay import Overlay

    original = Overlay.compact_into

    class Dying:
        def __init__(self, con):
            self._con = con

        def execute(self, sql, *args):
            result = self._con.execute(sql, *args)
            if sql.startswith("INSERT INTO fresh.chunks"):
                os.kill(os.getpid(), signal.SIGKILL)
            return result

        def __getattr__(self, name):
            return getattr(self._con, name)

    def compact_then_die(self, path):
        self.con = Dying(self.con)
        original(self, path)

    Overlay.compact_into = compact_then_die
