"""Write-back: KV computed on a miss is stored in the background, within the budget.

The query path hands a `ComputedKV` to `WriteBack.submit` and answers on; a thread takes what
has queued up and writes it as one new generation, under the store's single write lock
(waiting a while behind another process's write-back; behind a long ingest it gives up, and
a later miss computes the KV again). Per batch:
fold the hit logs, skip keys another process stored meanwhile (so concurrent misses of one
chunk leave one entry), let the budget decide what earns a place and what it evicts, seal
the shard, commit the rows, publish, delete shards nothing references.

A kill at any point leaves the published store as it was (data before index: a sealed but
uncommitted shard is an orphan gc removes); the next question computes the KV again. A
failed write (disk full, read-only store) logs one warning per engine, and answering goes on.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

import torch

from ragkv.errors import RagkvError, StoreLockedError
from store import budget
from store.catalog import ChunkLink
from store.gc import drop_dead
from store.writer import open_writer

log = logging.getLogger("ragkv")

MAX_PENDING = 64  # computed entries waiting to be written; beyond this a miss is not written back
SHARD_BYTES = 256 << 20
LOCK_WAIT_S = 30.0  # how long a write-back waits for another writer to finish


@dataclass(frozen=True)
class ComputedKV:
    """KV computed for a chunk on a miss, encoded as it is stored."""

    profile_id: str
    kv_key: str
    chunk_id: int
    token_ids: tuple[int, ...]
    parts: dict[str, torch.Tensor]  # codec.encode output: "" the data, others e.g. scales
    shard_metadata: dict[str, str]
    span_start: int | None = None  # chunk_index of the span its KV continues (None: stored alone)
    parent: str | None = None  # the key of the entry before it in its span (None: none)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts.values())


@dataclass
class WriteBackReport:
    stored: int = 0  # entries written
    linked: int = 0  # chunks linked to an entry another process had stored
    over_budget: int = 0  # not stored: colder than everything the budget holds
    evicted: int = 0  # entries the budget dropped to make room
    dropped: int = 0  # not stored: the queue was full, or the write failed
    failures: int = 0  # batches whose write failed


class WriteBack:
    """A background writer of computed KV into the store at `root` (a local folder)."""

    def __init__(self, root):
        self.root = root
        self.report = WriteBackReport()
        self._queue: queue.Queue[ComputedKV | None] = queue.Queue(MAX_PENDING)
        self._warned = False
        self._thread = threading.Thread(target=self._run, name="ragkv-writeback", daemon=True)
        self._thread.start()

    def submit(self, item: ComputedKV, wait: bool = False) -> bool:
        """Queue `item` to be written; False (and nothing queued) when the queue is full,
        unless `wait` (an ingest, which must store everything): then wait for room."""
        try:
            self._queue.put(item, block=wait)
            return True
        except queue.Full:
            self.report.dropped += 1
            return False

    def flush(self) -> None:
        """Wait until everything submitted so far is written (or given up)."""
        self._queue.join()

    def close(self) -> None:
        """Write what is queued, then stop the thread."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            batch = [item]
            while item is not None:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                batch.append(item)
            work = [b for b in batch if b is not None]
            try:
                if work:
                    self._write(work)
            except (OSError, RagkvError) as exc:
                self.report.failures += 1
                self.report.dropped += len(work)
                if not self._warned:
                    self._warned = True
                    log.warning(
                        "could not store computed KV in %s: %s; answering goes on, the KV is computed "
                        "again on the next miss",
                        self.root,
                        str(exc).splitlines()[0],
                    )
            except Exception:  # a bug must not end the thread: later submits would wait forever
                log.exception("write-back to %s failed", self.root)
            finally:
                for _ in batch:
                    self._queue.task_done()
            if item is None or batch[-1] is None:
                return

    def _open_writer(self):
        """The store's writer, waiting up to LOCK_WAIT_S behind another writer (an ingest may
        hold it for hours: then the batch is dropped, and computed again on a later miss)."""
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                return open_writer(self.root)
            except StoreLockedError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def _write(self, batch: list[ComputedKV]) -> None:
        try:
            writer = self._open_writer()
        except StoreLockedError:
            self.report.dropped += len(batch)
            log.info(
                "store %s stayed locked by another writer; %d computed KV entries not stored", self.root, len(batch)
            )
            return
        with writer:
            catalog = writer.catalog
            budget.fold_hits(writer)
            by_key = {b.kv_key: b for b in batch}
            alive = set(
                catalog.documents.chunk_texts([b.chunk_id for b in batch])
            )  # a re-ingest may have replaced some
            stored = catalog.entries.existing_keys(by_key)
            new = [b for b in by_key.values() if b.kv_key not in stored and b.chunk_id in alive]
            limit = catalog.usage.kv_budget()
            profile_id = batch[0].profile_id
            if limit is not None and new:
                new = self._within_budget(writer, profile_id, new, limit)
            if new:
                shards = writer.shard_writer(SHARD_BYTES, new[0].shard_metadata)
                for item in new:
                    catalog.entries.add_entries(item.profile_id, shards.add(item.kv_key, item.parts))
                catalog.entries.add_entries(profile_id, shards.flush())
            written = {b.kv_key for b in new} | stored
            links = {
                b.chunk_id: ChunkLink(b.chunk_id, b.kv_key, b.token_ids, b.span_start)
                for b in batch
                if b.chunk_id in alive and b.kv_key in written
            }  # one per chunk: it may have missed twice
            catalog.entries.link_chunks(profile_id, list(links.values()))
            self.report.stored += len(new)
            self.report.linked += sum(1 for b in by_key.values() if b.kv_key in stored)
            writer.publish()
            writer.delete_unreferenced_shards()

    def _within_budget(self, writer, profile_id: str, new: list[ComputedKV], limit: int) -> list[ComputedKV]:
        """The computed entries that earn a place; evicts colder stored KV to make room."""
        drop_dead(writer)
        fresh = [budget.Fresh(b.kv_key, b.nbytes, b.chunk_id, b.parent) for b in new]
        decision = budget.admit(writer, profile_id, fresh, limit)
        if decision.evict:
            drop_dead(writer)
        self.report.evicted += len(decision.evict)
        chosen = set(decision.compute)
        self.report.over_budget += len(new) - len(chosen)
        return [b for b in new if b.kv_key in chosen]
