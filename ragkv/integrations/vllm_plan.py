"""What the ragkv connector's scheduler side tells its workers each step
(ragkv.integrations.vllm): the loads and the saves, each with the request's blocks in every one
of vLLM's KV cache groups. The connector supports vLLM's hybrid allocator (`SupportsHMA`), so a
model with sliding-window layers keeps them in a group of their own, whose blocks hold only the
window (blocks before it are vLLM's null block); without the hybrid allocator one group holds
every layer's tokens. Import this module only inside vLLM."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from ragkv.integrations.store_match import SaveTarget, StoreMatch
from ragkv.store import EntryRow

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

Blocks = tuple[tuple[int, ...], ...]  # a request's block ids, per KV cache group


def blocks_of(group_block_ids: Sequence[Sequence[int]]) -> Blocks:
    return tuple(tuple(ids) for ids in group_block_ids)


@dataclass(frozen=True)
class LoadSpec:
    """One request's load: the entries covering prompt tokens 0..end, of which start..end
    (those vLLM's own cache lacks) go into `block_ids`."""

    request_id: str
    entries: tuple[EntryRow, ...]
    start: int
    end: int
    block_ids: Blocks
    pending: frozenset[str] = frozenset()  # keys of entries read from the fleet's pending KV


@dataclass(frozen=True)
class SaveSpec:
    """One request's save: `target`'s tokens, computed by the end of this step, in `block_ids`."""

    request_id: str
    target: SaveTarget
    block_ids: Blocks


@dataclass
class RagkvConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass
class PendingSave:
    """A request's chunks to save, in prompt order, each in the step that computes its last token."""

    targets: list[SaveTarget]
    block_ids: list[list[int]] = field(default_factory=list)  # per KV cache group, as allocated so far
    computed: int = 0  # the request's tokens computed before the step being scheduled

    def add_blocks(self, new: Sequence[Sequence[int]]) -> None:
        """Blocks the step allocated, per group (the first call sets them)."""
        if not self.block_ids:
            self.block_ids = [[] for _ in new]
        for held, added in zip(self.block_ids, new, strict=True):
            held += added


def plan_step(
    scheduler_output: SchedulerOutput,
    to_load: dict[str, tuple[StoreMatch, int, int]],
    pending_saves: dict[str, PendingSave],
) -> RagkvConnectorMetadata:
    """The step's loads (of the requests in `to_load` it schedules; `to_load` is emptied: one
    not scheduled after all was preempted, and vLLM computes its tokens) and saves (of
    `pending_saves`, updated with the blocks the step allocated; a save whose request was
    preempted meanwhile is dropped: its blocks were given away)."""
    meta = RagkvConnectorMetadata()
    for new in scheduler_output.scheduled_new_reqs:
        if new.req_id in to_load:
            match, start, end = to_load.pop(new.req_id)
            meta.loads.append(LoadSpec(new.req_id, match.entries, start, end, blocks_of(new.block_ids), match.pending))
        pending = pending_saves.get(new.req_id)
        if pending is not None:
            pending.block_ids = [list(ids) for ids in new.block_ids]
            pending.computed = new.num_computed_tokens
    to_load.clear()
    cached = scheduler_output.scheduled_cached_reqs
    for i, request_id in enumerate(cached.req_ids):
        pending = pending_saves.get(request_id)
        if pending is None:
            continue
        if request_id in cached.resumed_req_ids:
            del pending_saves[request_id]
            continue
        if cached.new_block_ids[i] is not None:
            pending.add_blocks(cached.new_block_ids[i])
        pending.computed = cached.num_computed_tokens[i]
    for request_id, pending in list(pending_saves.items()):
        scheduled = scheduler_output.num_scheduled_tokens.get(request_id, 0)
        done = pending.computed + scheduled  # the request's tokens computed by this step's end
        while scheduled and pending.targets and done >= pending.targets[0].end:
            meta.saves.append(SaveSpec(request_id, pending.targets.pop(0), blocks_of(pending.block_ids)))
        if not pending.targets:
            del pending_saves[request_id]
    return meta
