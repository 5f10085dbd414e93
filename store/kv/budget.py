"""The KV budget: which chunks' KV a store keeps when it may not keep all of it.

A budget caps the bytes of every KV entry in the store. The prefix KV and other models' KV
are never evicted; what is left of the budget goes to chunk KV, most popular first
(ragkv.store.kv.popularity), ties kept in favour of what is already stored and then by document order.
Every writer applies it: ingest (which chunks to precompute), the write-back of KV computed on
a miss (whether it earns a place), and `ragkv budget`.

A span's KV is a path, as in a radix tree of prefixes: chunk i's entry is usable only after
entries s..i-1 of its span. So the budget keeps every span as a prefix of itself:
- a use of chunk j credits the path s..j it needed: an entry scores the best of its own and
  every later chunk's popularity in the span, so scores never rise along a span;
- an entry is kept (or admitted) only when the entry before it is, so eviction takes a
  span's coldest tail first, and a continuation is admitted only onto the path it extends.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from itertools import groupby
from typing import NamedTuple

from ragkv.core.errors import InputError
from ragkv.store.catalog import Catalog
from ragkv.store.gc import drop_dead, maintaining
from ragkv.store.kv.popularity import HITS_DIR, read_pending, remove_finished
from ragkv.store.writer import StoreWriter

log = logging.getLogger("ragkv")


@dataclass(frozen=True)
class Candidate:
    """A chunk KV entry the budget ranks: stored already, or one that could be computed."""

    kv_key: str
    nbytes: int  # stored: exact; to compute: estimated
    score: float  # popularity now (a span's entry: of its path, see the module's docstring)
    is_stored: bool
    order: int = 0  # document order: the tie-break among equal scores
    parent: str | None = None  # the entry before it in its span (None: stored alone, or a span's first)


class Fresh(NamedTuple):
    """KV not stored yet that asks for a place: its key, bytes, chunk and the entry before it
    in its span (None: none)."""

    kv_key: str
    nbytes: int
    chunk_id: int
    parent: str | None = None


@dataclass(frozen=True)
class BudgetPlan:
    keep: list[str] = field(default_factory=list)  # stored keys that stay
    compute: list[str] = field(default_factory=list)  # keys to compute and store
    evict: list[str] = field(default_factory=list)  # stored keys to drop


def plan(candidates: Sequence[Candidate], room: int | None, compute_limit: int | None = None) -> BudgetPlan:
    """Fill `room` bytes (None: unlimited) with the most popular candidates; of those not
    stored, compute at most `compute_limit` bytes (None: no limit). A candidate that does not
    fit is passed over, so a smaller, colder one may still take the space left. A candidate
    with a parent is taken only after its parent (then at once: it scores no higher), and is
    dropped with it."""
    result = BudgetPlan()
    known = {c.kv_key for c in candidates}
    taken: set[str] = set()
    decided: set[str] = set()
    waiting: dict[str, list[Candidate]] = {}  # by parent: candidates ranked before their parent
    used = new = 0

    def decide(c: Candidate, allowed: bool) -> None:
        nonlocal used, new
        fits = allowed and (room is None or used + c.nbytes <= room)
        if c.is_stored:
            (result.keep if fits else result.evict).append(c.kv_key)
        elif fits and (compute_limit is None or new + c.nbytes <= compute_limit):
            result.compute.append(c.kv_key)
            new += c.nbytes
        else:
            fits = False
        decided.add(c.kv_key)
        if fits:
            taken.add(c.kv_key)
            used += c.nbytes
        for child in waiting.pop(c.kv_key, []):
            decide(child, fits)

    for c in sorted(candidates, key=lambda c: (-c.score, not c.is_stored, c.order)):
        if c.parent is None or c.parent in taken:
            decide(c, True)
        elif c.parent in known and c.parent not in decided:
            waiting.setdefault(c.parent, []).append(c)
        else:  # its parent has no KV, or lost its place: the entry is unusable
            decide(c, False)
    return result


def fold_hits(writer: StoreWriter) -> int:
    """Fold the readers' hit logs into the writer's catalog; returns the uses folded."""
    catalog = writer.catalog
    pending = read_pending(writer.root, catalog.usage.folded_offsets())
    if pending.unusable:  # said once: the offsets move past these lines
        log.warning(
            "hit logs: skipped %d lines that record no use (%s); popularity counts the rest",
            sum(pending.unusable.values()),
            ", ".join(f"{HITS_DIR}/{name}" for name in sorted(pending.unusable)),
        )
    folded = catalog.usage.fold_uses(pending, catalog.usage.half_life_s())
    remove_finished(writer.root, pending.finished)
    return folded


def stored_candidates(
    catalog: Catalog, profile_id: str, now: float | None = None, spans: Sequence[Candidate] | None = None
) -> list[Candidate]:
    """The chunk KV of `profile_id` the budget may evict, scored (a key shared by several
    chunks takes the best of their scores; a span's entry, the best along its path). `spans`:
    `span_candidates` already read for this `now` (else read here)."""
    now = now or time.time()
    stored = catalog.entries.stored_chunks(profile_id)
    scores = catalog.usage.chunk_scores([i for _, _, ids in stored for i in ids], now, catalog.usage.half_life_s())
    alone = [Candidate(key, nbytes, max(scores[i] for i in ids), True, min(ids)) for key, nbytes, ids in stored]
    spans = span_candidates(catalog, profile_id, now) if spans is None else spans
    return alone + [c for c in spans if c.is_stored]


def span_candidates(catalog: Catalog, profile_id: str, now: float) -> list[Candidate]:
    """Every chunk linked into a span under `profile_id`, stored or not (then `nbytes` is 0:
    the caller knows the size), scored by its path: the best popularity of it and every
    later chunk of its span."""
    chunks = catalog.entries.span_chunks(profile_id)
    scores = catalog.usage.chunk_scores([c.chunk_id for c in chunks], now, catalog.usage.half_life_s())
    found = []
    for _, group in groupby(chunks, key=lambda c: (c.doc_id, c.span_start)):
        span = list(group)
        best, path_scores = 0.0, []
        for c in reversed(span):
            best = max(best, scores[c.chunk_id])
            path_scores.append(best)
        parents = [None, *(c.kv_key for c in span[:-1])]
        for c, score, parent in zip(span, reversed(path_scores), parents, strict=True):
            found.append(Candidate(c.kv_key, c.nbytes or 0, score, c.nbytes is not None, c.chunk_id, parent))
    return found


def room_for_chunks(catalog: Catalog, budget: int | None, stored: Sequence[Candidate]) -> int | None:
    """Bytes of the budget left for evictable chunk KV: the budget less every other entry."""
    if budget is None:
        return None
    fixed = catalog.reports.kv_bytes() - sum(c.nbytes for c in stored)
    return budget - fixed


def admit(
    writer: StoreWriter,
    profile_id: str,
    fresh: Sequence[Fresh],
    limit: int | None,
    compute_limit: int | None = None,
    reserved: int = 0,
) -> BudgetPlan:
    """Which of `fresh` KV earns a place beside the stored chunk KV of `profile_id` within
    `limit` bytes (less `reserved`: entries about to be written outside the plan); the stored
    KV it outranks is evicted now (see `Entries.evict`, `drop_dead`). A fresh chunk of a span
    scores by its path, as stored ones do, when the span is linked already (a miss); else
    (ingest) by its own popularity and what `fresh` holds after it."""
    catalog = writer.catalog
    now = time.time()
    scores = catalog.usage.chunk_scores([f.chunk_id for f in fresh], now, catalog.usage.half_life_s())
    spans = span_candidates(catalog, profile_id, now)  # read once, for the fresh and the stored
    path_scores = {c.kv_key: c.score for c in spans}
    stored = stored_candidates(catalog, profile_id, now, spans)
    known = {c.kv_key for c in stored} | {f.kv_key for f in fresh}
    # a parent stored but linked by no chunk yet (ingest links its chunks after this) is a base
    outside = catalog.entries.existing_keys(f.parent for f in fresh if f.parent and f.parent not in known)
    candidates = _path_scored(
        [
            Candidate(
                f.kv_key,
                f.nbytes,
                path_scores.get(f.kv_key, scores[f.chunk_id]),
                False,
                f.chunk_id,
                None if f.parent in outside else f.parent,
            )
            for f in fresh
        ]
    )
    room = room_for_chunks(catalog, limit, stored)
    decision = plan(stored + candidates, None if room is None else room - reserved, compute_limit)
    if decision.evict:
        catalog.entries.evict(profile_id, decision.evict)
    return decision


def _path_scored(fresh: list[Candidate]) -> list[Candidate]:
    """`fresh` with each candidate's score raised to the best of the candidates that continue
    it (a chain through `parent`), so a path scores no lower than its tail."""
    by_key = {c.kv_key: c for c in fresh}
    best = {c.kv_key: c.score for c in fresh}
    for c in sorted(fresh, key=lambda c: -c.order):  # a span's later chunks first
        parent = c.parent
        while parent in by_key and best[parent] < best[c.kv_key]:
            best[parent] = best[c.kv_key]
            parent = by_key[parent].parent
    return [Candidate(c.kv_key, c.nbytes, best[c.kv_key], c.is_stored, c.order, c.parent) for c in fresh]


def enforce(writer: StoreWriter, profile_id: str, budget: int | None) -> list[str]:
    """Evict the coldest chunk KV of `profile_id` until the store's entries fit `budget`;
    returns the keys evicted (their rows dropped; see `drop_dead`)."""
    if budget is None:
        return []
    catalog = writer.catalog
    drop_dead(writer)
    stored = stored_candidates(catalog, profile_id)
    evicted = plan(stored, room_for_chunks(catalog, budget, stored)).evict
    if evicted:
        catalog.entries.evict(profile_id, evicted)
        drop_dead(writer)
    return evicted


@dataclass
class BudgetReport:
    store: str
    kv_budget: int | None  # bytes (None: no budget)
    kv_bytes: int  # bytes the store's KV takes now
    evicted: int = 0  # chunk KV entries dropped to fit
    generation: int = 0
    shards_deleted: int = 0
    bytes_reclaimed: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


def set_budget(root, size: int | None, wait: bool = False) -> BudgetReport:
    """Set (or with None, remove) the store's KV budget, evicting the coldest chunk KV of
    every profile until it fits, and publish; shard files nothing references are deleted."""
    with maintaining(root, wait) as writer:
        catalog = writer.catalog
        fold_hits(writer)
        report = BudgetReport(writer.location, size, 0)
        if size is not None:
            check_budget(size, catalog.reports.prefix_bytes())
            for profile in catalog.entries.profiles():
                report.evicted += len(enforce(writer, profile.profile_id, size))
        catalog.set_meta({"kv_budget": "" if size is None else str(size)})
        report.kv_bytes = catalog.reports.kv_bytes()
        report.generation = writer.publish()
        report.shards_deleted, report.bytes_reclaimed = writer.delete_unreferenced_shards()
    return report


def budget_status(root) -> BudgetReport:
    """The store's KV budget and the bytes its KV takes, read from the current generation."""
    from ragkv.store.snapshot import open_snapshot

    with open_snapshot(root, require_documents=False) as snapshot:
        catalog = snapshot.catalog
        return BudgetReport(
            snapshot.location, catalog.usage.kv_budget(), catalog.reports.kv_bytes(), generation=snapshot.generation
        )


def check_budget(budget: int, prefix_bytes: int) -> None:
    if budget < prefix_bytes:
        raise InputError(
            f"KV budget {format_bytes(budget)} is smaller than the system prompt's KV "
            f"({format_bytes(prefix_bytes)}); give at least {format_bytes(prefix_bytes)}"
        )


def format_bytes(size: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(size) < 1000 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size} B"
