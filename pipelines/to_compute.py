"""The chunks whose KV ingest computes, each with the key its entry is stored under: a chunk
alone, or a document's chunks cut into spans (computed as one sequence, keyed by the chain of
ragkv.kv.spans); and the units one sequence computes."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ragkv.core.keys import KVKey, Profile
from ragkv.kv import codec, spans
from ragkv.model.forward import compute_prefix
from ragkv.model.llm import LoadedModel
from ragkv.model.prompt import encode_text
from ragkv.store import ChunkRow, StoreWriter
from ragkv.store.kv import budget


@dataclass(frozen=True)
class PendingChunk:
    chunk_id: int
    text: str
    token_ids: tuple[int, ...]
    key: str
    span_start: int | None = None  # chunk_index of the span this chunk's KV continues (None: alone)
    segment: tuple[int, ...] = ()  # ids its entry holds: the chunk's, after a separator within a span

    @property
    def ids(self) -> tuple[int, ...]:
        return self.segment or self.token_ids


@dataclass(frozen=True)
class Unit:
    """One sequence computed after the prefix: a chunk alone, or a span of a document's
    chunks. Its KV is cut into the chunks' entries; only those not stored yet are written."""

    chunks: list[PendingChunk]
    store: list[bool]  # per chunk: whether its key still needs writing

    @property
    def ids(self) -> list[int]:
        return [t for c in self.chunks for t in c.ids]


def pending_alone(chunk: ChunkRow, tokenizer, profile: Profile) -> PendingChunk:
    ids = tuple(encode_text(tokenizer, chunk.text))
    return PendingChunk(chunk.chunk_id, chunk.text, ids, KVKey.for_chunk(profile, ids).to_string())


def pending_spans(
    chunks: list[ChunkRow], tokenizer, profile: Profile, separator: Sequence[int], span_tokens: int
) -> list[PendingChunk]:
    """Chunks of each document, in order, cut into spans of at most `span_tokens` tokens (a
    new span starts where the next chunk would pass it; a longer chunk is a span of its own).
    A span's first chunk is keyed and computed as if alone; every later one continues it:
    its entry holds separator + chunk, computed after everything before it in the span.
    Spans keep a document's top-level sections whole as chunks do: a section whose chunks fit
    in a span but not in what is left of the current one opens a new span."""
    by_doc: dict[str, list[ChunkRow]] = {}
    for chunk in chunks:
        by_doc.setdefault(chunk.doc_id, []).append(chunk)
    pending: list[PendingChunk] = []
    for doc_chunks in by_doc.values():
        ordered = sorted(doc_chunks, key=lambda c: c.chunk_index)
        token_ids = [tuple(encode_text(tokenizer, c.text)) for c in ordered]
        sections = _section_sizes(ordered, [len(spans.segment(1, ids, separator)) for ids in token_ids])
        grouped: list[list[tuple[ChunkRow, tuple[int, ...]]]] = []  # the document's spans
        used = 0
        for chunk, ids in zip(ordered, token_ids, strict=True):
            whole = sections.get(chunk.chunk_index)  # a section starts here: its size as one run
            keeps_section = whole is not None and used + whole > span_tokens >= whole
            if not grouped or keeps_section or used + len(spans.segment(1, ids, separator)) > span_tokens:
                grouped.append([])
                used = 0
            used += len(spans.segment(0 if not grouped[-1] else 1, ids, separator))
            grouped[-1].append((chunk, ids))
        for run in grouped:
            start, chunk_ids = run[0][0].chunk_index, [ids for _, ids in run]
            keys = spans.span_keys(profile, chunk_ids, separator)
            for (chunk, ids), key, piece in zip(run, keys, spans.segments(chunk_ids, separator), strict=True):
                pending.append(PendingChunk(chunk.chunk_id, chunk.text, ids, key.to_string(), start, piece))
    return pending


def _section_sizes(ordered: list[ChunkRow], sizes: list[int]) -> dict[int, int]:
    """{chunk index a top-level section starts at: the tokens its chunks take in a span}. The
    top level is the outermost heading level at which the document's chunks differ."""
    depth = next(
        (d for d in range(1, 4) if len({c.section[:d] for c in ordered}) > 1),
        0,
    )
    if not depth:
        return {}
    found: dict[int, int] = {}
    first, previous = None, None
    for chunk, size in zip(ordered, sizes, strict=True):
        if first is None or chunk.section[:depth] != previous:
            first, previous = chunk.chunk_index, chunk.section[:depth]
            found[first] = 0
        found[first] += size
    return found


def units_of(pending: list[PendingChunk]) -> list[list[PendingChunk]]:
    """Chunks alone, and spans (consecutive chunks sharing a span start), in order."""
    return spans.runs(
        pending,
        lambda previous, p: (
            p.span_start is not None and p.segment != p.token_ids and previous.span_start == p.span_start
        ),
    )


@dataclass(frozen=True)
class Work:
    """What ingest computes: the units holding a key not stored yet, and the prefix's key when
    the store lacks its entry; chunks whose key is stored (or repeated) are reused."""

    units: list[Unit]
    prefix_key: str | None
    num_reused: int
    tokens_reused: int


def plan_work(catalog, pending: list[PendingChunk], profile: Profile) -> Work:
    """A unit per chunk alone, or per span, holding a key not stored yet (each distinct key
    written once)."""
    prefix_key = KVKey.for_prefix(profile).to_string()
    stored = catalog.entries.existing_keys([prefix_key] + [p.key for p in pending])
    units: list[Unit] = []
    num_reused = tokens_reused = 0
    for group in units_of(pending):
        store = []
        for p in group:
            new = p.key not in stored
            stored.add(p.key)
            store.append(new)
            if not new:  # stored already, or identical to another chunk of this run
                num_reused += 1
                tokens_reused += len(p.token_ids)
        if any(store):
            units.append(Unit(group, store))
    return Work(units, None if prefix_key in stored else prefix_key, num_reused, tokens_reused)


@dataclass(frozen=True)
class Admitted:
    """What a KV budget lets ingest compute now."""

    pending: list[PendingChunk]  # the chunks to compute (or stored already): whole spans' prefixes
    num_evicted: int  # stored chunk KV dropped for more popular chunks
    num_deferred: int  # chunks left without KV: computed on their first miss


def within_budget(
    writer: StoreWriter,
    pending: list[PendingChunk],
    lm: LoadedModel,
    profile: Profile,
    limit: int | None,
    precompute: int | None,
) -> Admitted:
    """The chunks whose KV to compute now: the most popular that fit the budget `limit` (and,
    of new KV, at most `precompute` bytes), chunks whose KV is stored already always. Stored
    KV colder than what is chosen is evicted. The rest stay without KV (computed on a miss).
    A span is admitted as a prefix of itself: a chunk only after the chunk before it."""
    catalog = writer.catalog
    prefix_parts = codec.encode(compute_prefix(lm.model, profile.prefix_ids), profile.kv_quant)
    prefix_bytes = sum(t.numel() * t.element_size() for t in prefix_parts.values())
    if limit is not None:
        budget.check_budget(limit, prefix_bytes)
    # every entry of a model with recurrent layers ends with a state of one size, whatever its length
    state_bytes = sum(t.numel() * t.element_size() for n, t in prefix_parts.items() if n.startswith(codec.STATE_PREFIX))
    per_token = (prefix_bytes - state_bytes) / max(len(profile.prefix_ids), 1)
    stored_keys = catalog.entries.existing_keys(p.key for p in pending)
    units = units_of(pending)
    parents = {p.key: before.key for unit in units for before, p in zip(unit, unit[1:], strict=False)}
    fresh = [
        budget.Fresh(p.key, math.ceil(len(p.ids) * per_token) + state_bytes, p.chunk_id, parents.get(p.key))
        for p in pending
        if p.key not in stored_keys
    ]
    writes_prefix = not catalog.entries.existing_keys([KVKey.for_prefix(profile).to_string()])
    decision = budget.admit(
        writer, profile.profile_id, fresh, limit, precompute, reserved=prefix_bytes if writes_prefix else 0
    )
    usable = stored_keys | set(decision.compute)
    admitted = [p for unit in units for p in _usable_prefix(unit, usable)]
    return Admitted(admitted, len(decision.evict), len(fresh) - len(decision.compute))


def _usable_prefix(unit: list[PendingChunk], usable: set[str]) -> list[PendingChunk]:
    """The chunks of `unit` up to the first whose KV is neither stored nor to be computed."""
    prefix = []
    for p in unit:
        if p.key not in usable:
            break
        prefix.append(p)
    return prefix
