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
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ragkv.core.errors import RagkvError, StoreLockedError
from ragkv.store.catalog import ChunkLink
from ragkv.store.gc import drop_dead
from ragkv.store.kv import budget
from ragkv.store.kv.pending import ComputedKV, PendingArea, PendingWriter, read_objects
from ragkv.store.kv.pending_hits import read_hits
from ragkv.store.kv.popularity import HITS_DIR
from ragkv.store.objects import is_remote
from ragkv.store.writer import open_writer

log = logging.getLogger("ragkv")

MAX_PENDING = 64  # computed entries waiting to be written; beyond this a miss is not written back
SHARD_BYTES = 256 << 20
LOCK_WAIT_S = 30.0  # how long a write-back waits for another writer to finish
PENDING_BYTES = 1 << 30  # a reader's own pending KV on an S3 store, beyond which its oldest goes


@dataclass
class WriteBackReport:
    stored: int = 0  # entries written
    linked: int = 0  # chunks linked to an entry another process had stored
    over_budget: int = 0  # not stored: colder than everything the budget holds
    evicted: int = 0  # entries the budget dropped to make room
    dropped: int = 0  # not stored: the queue was full, or the write failed
    failures: int = 0  # batches whose write failed


def leaves_pending(root, leave_pending: bool = False, writer: bool = False) -> bool:
    """Whether a process that computes KV for the store at `root` leaves it under pending/ for
    the one writer's fold rather than writing generations itself: always on S3 (a reader never
    takes the bucket's lock) unless it is `writer`, the store's one writer (an ingest's KV
    half); on a folder when asked (`leave_pending`)."""
    return leave_pending or (is_remote(root) and not writer)


class WriteBack:
    """A background writer of computed KV into the store at `root` (a folder or S3)."""

    def __init__(self, root, pending_bytes: int = PENDING_BYTES, leave_pending: bool = False, writer: bool = False):
        self.root = root
        self.report = WriteBackReport()
        leave = leaves_pending(root, leave_pending, writer)
        self.pending = PendingWriter(root, pending_bytes) if leave else None
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
        if self.pending is not None:  # not the store's writer: leave it for the one writer to fold
            self.pending.put(batch)
            return
        try:
            writer = self._open_writer()
        except StoreLockedError:
            self.report.dropped += len(batch)
            log.info(
                "store %s stayed locked by another writer; %d computed KV entries not stored", self.root, len(batch)
            )
            return
        with writer:
            budget.fold_hits(writer)
            commit_computed(writer, batch, self.report)
            writer.publish()
            writer.delete_unreferenced_shards()


def commit_computed(writer, batch: list[ComputedKV], report: WriteBackReport) -> None:
    """Store `batch` in the generation `writer` builds: each entry whose chunk is still there
    and whose key is not stored yet, within the budget (which may evict colder KV), then link
    the chunks; the caller publishes."""
    catalog = writer.catalog
    by_key = {b.kv_key: b for b in batch}
    alive = set(catalog.documents.chunk_texts([b.chunk_id for b in batch]))  # a re-ingest may have replaced some
    stored = catalog.entries.existing_keys(by_key)
    new = [b for b in by_key.values() if b.kv_key not in stored and b.chunk_id in alive]
    limit = catalog.usage.kv_budget()
    for profile_id in sorted({b.profile_id for b in batch}):
        mine = [b for b in new if b.profile_id == profile_id]
        admitted = _within_budget(writer, profile_id, mine, limit, report) if limit is not None and mine else mine
        if admitted:
            shards = writer.shard_writer(SHARD_BYTES, admitted[0].shard_metadata)
            for item in admitted:
                catalog.entries.add_entries(profile_id, shards.add(item.kv_key, item.parts))
            catalog.entries.add_entries(profile_id, shards.flush())
        written = {b.kv_key for b in admitted} | stored
        links = {
            b.chunk_id: ChunkLink(b.chunk_id, b.kv_key, b.token_ids, b.span_start)
            for b in batch
            if b.profile_id == profile_id and b.chunk_id in alive and b.kv_key in written
        }  # one per chunk: it may have missed twice
        catalog.entries.link_chunks(profile_id, list(links.values()))
        report.stored += len(admitted)
    report.linked += sum(1 for b in by_key.values() if b.kv_key in stored)


def _within_budget(
    writer, profile_id: str, new: list[ComputedKV], limit: int, report: WriteBackReport
) -> list[ComputedKV]:
    """The computed entries that earn a place; evicts colder stored KV to make room."""
    drop_dead(writer)
    fresh = [budget.Fresh(b.kv_key, b.nbytes, b.chunk_id, b.parent) for b in new]
    decision = budget.admit(writer, profile_id, fresh, limit)
    if decision.evict:
        drop_dead(writer)
    report.evicted += len(decision.evict)
    chosen = set(decision.compute)
    report.over_budget += len(new) - len(chosen)
    return [b for b in new if b.kv_key in chosen]


@dataclass
class FoldReport:
    store: str
    objects: int = 0  # whole pending objects folded
    entries: int = 0  # entries they held
    stored: int = 0  # entries stored (the rest: stored already, chunk gone, or over the budget)
    damaged: int = 0  # objects skipped and deleted
    incomplete: int = 0  # objects a killed replica left without a manifest, deleted
    uses_folded: int = 0
    hit_objects: int = 0  # readers' hits objects folded
    generation: int = 0
    folded: list[str] = field(default_factory=list, repr=False)  # pending objects to delete once published

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "folded"}

    def delete_folded(self) -> None:
        """Delete the pending objects this fold took (call once its generation is published)."""
        area = PendingArea(self.store)
        for name in self.folded:
            area.delete(name)


def fold_pending(writer) -> FoldReport:
    """Fold the readers' hit logs, pending hits and pending KV (ragkv.store.kv.pending) into the
    generation `writer` builds; the folded objects are deleted once it is published
    (`FoldReport.delete_folded`)."""
    area = PendingArea(writer.location)
    usage = writer.catalog.usage
    names = area.names()  # one listing for both kinds of object
    hits = read_hits(area, usage.folded_offsets(), names)
    if not hits.uses:  # gone objects' offsets are forgotten with the next uses, not as a change alone
        hits.finished.clear()
    if hits.unusable:
        skipped = sum(hits.unusable.values())
        log.warning("pending hits: skipped %d lines that record no use; popularity counts the rest", skipped)
    found = read_objects(area, names)
    report = FoldReport(writer.location, damaged=len(found.damaged) // 2, incomplete=len(found.stale))
    report.uses_folded = budget.fold_hits(writer) + usage.fold_uses(hits, usage.half_life_s())
    report.hit_objects = len(hits.offsets)
    if found.items:
        done = WriteBackReport()
        commit_computed(writer, found.items, done)
        report.stored = done.stored
    report.objects, report.entries = len(found.objects) // 2, len(found.items)
    report.folded = found.objects + found.damaged + found.stale + list(hits.offsets)
    return report


def fold(root, wait: bool = False) -> FoldReport:
    """`ragkv fold`: fold the readers' pending KV and hit logs into the store at `root`, publish."""
    from ragkv.store.gc import maintaining

    with maintaining(root, wait) as writer:
        report = fold_pending(writer)
        report.generation = writer.publish()
        report.delete_folded()
        writer.delete_unreferenced_shards()
    return report


def anything_to_fold(root) -> bool:
    """Whether readers left anything for a fold at `root` (pending objects, or hit log files on
    a folder); cheap: a listing, no lock. A writer replica folds only then, so an idle fleet
    publishes no generations."""
    if PendingArea(root).names():
        return True
    return not is_remote(root) and any(Path(root, HITS_DIR).glob("*.jsonl"))


class FoldLoop:
    """A replica that is its store's writer (`ragkv serve --writer`): a thread that folds what
    the other replicas left pending every `every_s` seconds. A fold that finds the store
    locked (an ingest holds it) waits for the next round; one that fails logs a warning."""

    def __init__(self, root, every_s: float):
        self.root = root
        self.every_s = every_s
        self.folds = 0  # folds published
        self.last: FoldReport | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ragkv-fold", daemon=True)

    def start(self) -> FoldLoop:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop after the fold under way, if any."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def fold_once(self) -> FoldReport | None:
        """One fold now, if readers left anything; None if not, if another writer held the
        store, or if the fold failed."""
        try:
            if not anything_to_fold(self.root):
                return None
            report = fold(self.root)
        except StoreLockedError:
            log.info("fold skipped: store %s is locked by another writer", self.root)
            return None
        except (OSError, RagkvError) as exc:
            log.warning("fold of %s failed: %s; the next one retries", self.root, str(exc).splitlines()[0])
            return None
        self.folds += 1
        self.last = report
        return report

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.fold_once()
