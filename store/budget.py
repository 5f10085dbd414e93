"""The KV budget: which chunks' KV a store keeps when it may not keep all of it.

A budget caps the bytes of every KV entry in the store. The prefix KV, other models' KV and
document spans are not evicted one chunk at a time; what is left of the budget goes to chunk
KV, most popular first (store.popularity), ties kept in favour of what is already stored and
then by document order. Every writer applies it: ingest (which chunks to precompute), the
write-back of KV computed on a miss (whether it earns a place), and `ragkv budget`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from ragkv.errors import InputError
from store.catalog import Catalog
from store.gc import drop_dead, maintaining
from store.popularity import HITS_DIR, read_pending, remove_finished
from store.store import StoreWriter

log = logging.getLogger("ragkv")


@dataclass(frozen=True)
class Candidate:
    """A chunk KV entry the budget ranks: stored already, or one that could be computed."""

    kv_key: str
    nbytes: int  # stored: exact; to compute: estimated
    score: float  # popularity now
    is_stored: bool
    order: int = 0  # document order: the tie-break among equal scores


@dataclass(frozen=True)
class BudgetPlan:
    keep: list[str] = field(default_factory=list)  # stored keys that stay
    compute: list[str] = field(default_factory=list)  # keys to compute and store
    evict: list[str] = field(default_factory=list)  # stored keys to drop


def plan(candidates: Sequence[Candidate], room: int | None, compute_limit: int | None = None) -> BudgetPlan:
    """Fill `room` bytes (None: unlimited) with the most popular candidates; of those not
    stored, compute at most `compute_limit` bytes (None: no limit). A candidate that does not
    fit is passed over, so a smaller, colder one may still take the space left."""
    result = BudgetPlan()
    used = new = 0
    for c in sorted(candidates, key=lambda c: (-c.score, not c.is_stored, c.order)):
        fits = room is None or used + c.nbytes <= room
        if c.is_stored:
            (result.keep if fits else result.evict).append(c.kv_key)
            used += c.nbytes if fits else 0
        elif fits and (compute_limit is None or new + c.nbytes <= compute_limit):
            result.compute.append(c.kv_key)
            used, new = used + c.nbytes, new + c.nbytes
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


def stored_candidates(catalog: Catalog, profile_id: str, now: float | None = None) -> list[Candidate]:
    """The chunk KV of `profile_id` the budget may evict, scored (a key shared by several
    chunks takes the best of their scores)."""
    stored = catalog.entries.stored_chunks(profile_id)
    scores = catalog.usage.chunk_scores(
        [i for _, _, ids in stored for i in ids], now or time.time(), catalog.usage.half_life_s()
    )
    return [Candidate(key, nbytes, max(scores[i] for i in ids), True, min(ids)) for key, nbytes, ids in stored]


def room_for_chunks(catalog: Catalog, budget: int | None, stored: Sequence[Candidate]) -> int | None:
    """Bytes of the budget left for evictable chunk KV: the budget less every other entry."""
    if budget is None:
        return None
    fixed = catalog.reports.kv_bytes() - sum(c.nbytes for c in stored)
    return budget - fixed


def admit(
    writer: StoreWriter,
    profile_id: str,
    fresh: Sequence[tuple[str, int, int]],
    limit: int | None,
    compute_limit: int | None = None,
    reserved: int = 0,
) -> BudgetPlan:
    """Which of `fresh` KV, `(kv_key, nbytes, chunk_id)` not stored yet, earns a place beside
    the stored chunk KV of `profile_id` within `limit` bytes (less `reserved`: entries about to
    be written outside the plan); the stored KV it outranks is unlinked now (see `drop_dead`)."""
    catalog = writer.catalog
    now = time.time()
    scores = catalog.usage.chunk_scores([chunk_id for _, _, chunk_id in fresh], now, catalog.usage.half_life_s())
    candidates = [Candidate(key, nbytes, scores[chunk_id], False, chunk_id) for key, nbytes, chunk_id in fresh]
    stored = stored_candidates(catalog, profile_id, now)
    room = room_for_chunks(catalog, limit, stored)
    decision = plan(stored + candidates, None if room is None else room - reserved, compute_limit)
    if decision.evict:
        catalog.entries.unlink_keys(profile_id, decision.evict)
    return decision


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
        catalog.entries.unlink_keys(profile_id, evicted)
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
    from store.snapshot import open_snapshot

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
