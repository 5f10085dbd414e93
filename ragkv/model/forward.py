"""The forward that computes KV: the shared prefix once, then chunks in padded batches on top of
it. Ingest, repair, the Ray workers and the query path (the separator's KV) all compute here.

Each chunk is computed right after the prefix (positions P..P+T-1), exactly where `ask`
will place it. Batches are right-padded: under a causal mask a real token never attends to
the padding after it, so padding changes no real token's KV. A recurrent layer's state would
take the padding in, so for a model with one, only chunks of one length share a batch, and a
span's chunks are computed one after another, each keeping the state at its end.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from ragkv.kv import cache as kv
from ragkv.kv.entry import Entry


@dataclass(frozen=True)
class ChunkKV:
    index: int  # position of the chunk in the list given to `compute_chunks`
    kv: Entry  # on the CPU


@torch.inference_mode()
def compute_prefix(model, prefix_ids: Sequence[int]) -> Entry:
    """The entry of the prefix ids alone (its state too, for recurrent layers), on the model's device."""
    cache = kv.to_cache_empty(model.config)
    ids = torch.tensor([list(prefix_ids)], dtype=torch.long, device=model.device)  # (1, P)
    model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    return kv.from_cache(cache)


def plan_batches(lengths: Sequence[int], batch_tokens: int, equal: bool = False) -> list[list[int]]:
    """Group chunk indices, longest first, so each batch's padded size (rows x longest) stays
    within `batch_tokens` (a chunk longer than that gets a batch of its own). `equal`: only
    chunks of one length share a batch (no padding: a recurrent state would take it in)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    for i in order:
        fits = batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= batch_tokens
        if fits and (not equal or lengths[batches[-1][0]] == lengths[i]):
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


@torch.inference_mode()
def compute_chunks(
    model, prefix: Entry, chunk_ids: Sequence[Sequence[int]], batch_tokens: int, pad_id: int
) -> Iterator[ChunkKV]:
    """Yield each chunk's entry computed after `prefix`, batch by batch. For a model with
    recurrent layers, chunks share a batch only with chunks of their length, so each row's
    state is its own chunk's, with no padding after it."""
    num_prefix = prefix.num_tokens
    equal = kv.layout_of(model.config).has_state
    for batch in plan_batches([len(c) for c in chunk_ids], batch_tokens, equal):
        longest = len(chunk_ids[batch[0]])
        ids = torch.full((len(batch), longest), pad_id, dtype=torch.long)  # (B, T)
        for row, index in enumerate(batch):
            ids[row, : len(chunk_ids[index])] = torch.tensor(chunk_ids[index])
        cache = kv.to_cache([prefix], model.config, batch_size=len(batch))
        model(input_ids=ids.to(model.device), cache=cache, use_cache=True, logits_to_keep=1)
        for row, index in enumerate(batch):
            chunk = kv.from_cache(cache, row, num_prefix, num_prefix + len(chunk_ids[index]))
            yield ChunkKV(index, chunk.to("cpu"))


def compute_segments(model, before: Sequence[Entry], segments: Sequence[Sequence[int]]) -> list[Entry]:
    """Each of `segments` (token ids that follow each other) computed after the entries
    `before`, one forward per segment, as an entry of its own with the state after it (what a
    model with recurrent layers needs to continue from any segment's end), on the model's device."""
    return extend(model, kv.to_cache(before, model.config), segments)


@torch.inference_mode()
def extend(model, cache, segments: Sequence[Sequence[int]]) -> list[Entry]:
    """Run `segments` one after another on top of `cache` (batch 1; it grows by all of them),
    one forward each, and return each one's entry with the state at its end."""
    start = kv.num_cached(cache)
    entries = []
    for ids in segments:
        batch = torch.tensor([list(ids)], dtype=torch.long, device=model.device)  # (1, T)
        model(input_ids=batch, cache=cache, use_cache=True, logits_to_keep=1)
        entries.append(kv.from_cache(cache, 0, start, start + len(ids)))
        start += len(ids)
    return entries


def compute_spans(
    model, prefix: Entry, span_list: Sequence[Sequence[Sequence[int]]], batch_tokens: int, pad_id: int
) -> Iterator[tuple[int, list[Entry]]]:
    """Each span's index in `span_list` and its segments' entries (see `split_segments`): a
    span's segments computed as one sequence after `prefix`, batch by batch (a chunk stored alone
    is a span of one segment). For a model with recurrent layers, a span of several segments is
    computed segment by segment (`compute_segments`), so each has the state at its own end."""
    stateful = kv.layout_of(model.config).has_state
    several = [i for i, span in enumerate(span_list) if stateful and len(span) > 1]
    for index in several:
        yield index, [entry.to("cpu") for entry in compute_segments(model, [prefix], span_list[index])]
    taken = set(several)
    rest = [i for i in range(len(span_list)) if i not in taken]
    sequences = [[t for segment in span_list[i] for t in segment] for i in rest]
    for result in compute_chunks(model, prefix, sequences, batch_tokens, pad_id):
        index = rest[result.index]
        yield index, split_segments(result.kv, [len(s) for s in span_list[index]])


def split_segments(entry: Entry, lengths: Sequence[int]) -> list[Entry]:
    """Cut a sequence's entry of `sum(lengths)` tokens into consecutive parts of `lengths` tokens
    (contiguous copies: each is stored on its own; a state stays with the last)."""
    parts, start = [], 0
    for length in lengths:
        parts.append(entry.tokens(start, start + length))
        start += length
    return parts
