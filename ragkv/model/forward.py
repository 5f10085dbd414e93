"""The forward that computes KV: the shared prefix once, then chunks in padded batches on top of
it. Ingest, repair, the Ray workers and the query path (the separator's KV) all compute here.

Each chunk is computed right after the prefix (positions P..P+T-1), exactly where `ask`
will place it. Batches are right-padded: under a causal mask a real token never attends to
the padding after it, so padding changes no real token's KV.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from ragkv.kv import cache as kv


def shard_metadata(profile_id: str, model_name: str, dtype: str, layout: str = "L2HTD") -> dict[str, str]:
    """What a KV shard's header says about its entries (`layout`: `KVLayout.name`)."""
    return {"layout": layout, "profile_id": profile_id, "model": model_name, "dtype": dtype}


@dataclass(frozen=True)
class ChunkKV:
    index: int  # position of the chunk in the list given to `compute_chunks`
    kv: torch.Tensor  # (L, 2, H, T, D) on the CPU


@torch.inference_mode()
def compute_prefix(model, prefix_ids: Sequence[int]) -> torch.Tensor:
    """KV of the prefix ids alone: `(L, 2, H, P, D)`, on the model's device."""
    cache = kv.to_cache_empty(model.config)
    ids = torch.tensor([list(prefix_ids)], dtype=torch.long, device=model.device)  # (1, P)
    model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    return kv.from_cache(cache)


def plan_batches(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Group chunk indices, longest first, so each batch's padded size (rows x longest) stays
    within `batch_tokens` (a chunk longer than that gets a batch of its own)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


@torch.inference_mode()
def compute_chunks(
    model, prefix_kv: torch.Tensor, chunk_ids: Sequence[Sequence[int]], batch_tokens: int, pad_id: int
) -> Iterator[ChunkKV]:
    """Yield each chunk's KV computed after `prefix_kv` (`(L, 2, H, P, D)`), batch by batch."""
    num_prefix = kv.num_tokens(prefix_kv)
    for batch in plan_batches([len(c) for c in chunk_ids], batch_tokens):
        longest = len(chunk_ids[batch[0]])
        ids = torch.full((len(batch), longest), pad_id, dtype=torch.long)  # (B, T)
        for row, index in enumerate(batch):
            ids[row, : len(chunk_ids[index])] = torch.tensor(chunk_ids[index])
        cache = kv.to_cache([prefix_kv], model.config, batch_size=len(batch))
        model(input_ids=ids.to(model.device), cache=cache, use_cache=True, logits_to_keep=1)
        for row, index in enumerate(batch):
            chunk = kv.from_cache(cache, row, num_prefix, num_prefix + len(chunk_ids[index]))
            yield ChunkKV(index, chunk.cpu())


def compute_spans(
    model, prefix_kv: torch.Tensor, span_list: Sequence[Sequence[Sequence[int]]], batch_tokens: int, pad_id: int
) -> Iterator[tuple[int, list[torch.Tensor]]]:
    """Each span's index in `span_list` and its segments' KV (`(L, 2, H, T, D)` each, see
    `split_segments`): a span's segments computed as one sequence after `prefix_kv`, batch by
    batch (a chunk stored alone is a span of one segment)."""
    sequences = [[t for segment in span for t in segment] for span in span_list]
    for result in compute_chunks(model, prefix_kv, sequences, batch_tokens, pad_id):
        yield result.index, split_segments(result.kv, [len(s) for s in span_list[result.index]])


def split_segments(kv_tensor: torch.Tensor, lengths: Sequence[int]) -> list[torch.Tensor]:
    """Cut a sequence's KV `(L, 2, H, sum(lengths), D)` into consecutive parts of `lengths`
    tokens (contiguous copies: each is stored on its own)."""
    parts, start = [], 0
    for length in lengths:
        parts.append(kv_tensor[:, :, :, start : start + length].contiguous())
        start += length
    return parts
