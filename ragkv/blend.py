"""Selective recompute (approximate), CacheBlend-style (`blend`) and EPIC-style
(`recompute_starts`). CacheBlend: after chunks' stored KV are placed one
after another (`concat`), recompute the KV of the fraction of context tokens that deviate
most from a full prefill, so that cross-chunk attention is partly restored.

Selection follows CacheBlend: the first layers are cheap to compute exactly for every token
(2 of L layers); the tokens whose layer-1 values differ most from the concatenated cache are
the ones whose KV the missing cross-attention changed most. Those tokens then run through
the whole model at their own positions, attending to the (mixed) cache, and their fresh KV
replaces the stale one in every layer. With ratio 1.0 this is a full recompute of the context.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Sequence

import torch

from ragkv import kv

SELECTION_LAYERS = 2  # layer 0 is exact after re-rotation; layer 1 is the first that deviates


@dataclass(frozen=True)
class BlendResult:
    num_recomputed: int


@contextmanager
def _first_layers(model, num_layers: int):
    """Run `model` with only its first `num_layers` decoder layers (then restore them)."""
    layers = model.model.layers
    model.model.layers = layers[:num_layers]
    try:
        yield
    finally:
        model.model.layers = layers


@torch.inference_mode()
def blend(model, cache, context_ids: Sequence[int], start: int, ratio: float) -> BlendResult:
    """Recompute, in place, the KV of the `ratio` share of `context_ids[start:]` that deviates
    most. `cache` holds approximate KV for all of `context_ids` (batch 1)."""
    total = len(context_ids)
    count = min(total - start, max(1, round(ratio * (total - start)))) if ratio > 0 and total > start else 0
    if count == 0:
        return BlendResult(0)
    ids = torch.tensor([list(context_ids)], dtype=torch.long, device=model.device)  # (1, T)
    exact = kv.to_cache_empty(model.config)
    with _first_layers(model, SELECTION_LAYERS):
        model.model(input_ids=ids, cache=exact, use_cache=True)
    kv.overwrite_layers(cache, exact, SELECTION_LAYERS)
    deviation = kv.layer_deviation(cache, exact, SELECTION_LAYERS - 1, start)  # (T - start,)
    chosen = (deviation.topk(count).indices + start).sort().values  # (S,) context positions
    _recompute(model, cache, ids, chosen)
    return BlendResult(count)


@torch.inference_mode()
def recompute_starts(model, cache, context_ids: Sequence[int], starts: Sequence[int], lengths: Sequence[int],
                     ratio: float) -> BlendResult:
    """EPIC/LegoLink-style (approximate): recompute, in place, the first `ratio` share of each
    passage that starts at `starts[i]` and runs `lengths[i]` tokens (at least one token each
    when ratio > 0). A passage computed on its own learned to treat its own first tokens as the
    attention sink; recomputed at their real place, attending to everything before them, they
    stop drawing attention the full prefill would not give them."""
    if ratio <= 0 or not starts:
        return BlendResult(0)
    chosen = [p for start, length in zip(starts, lengths)
              for p in range(start, start + min(length, max(1, round(ratio * length))))]
    ids = torch.tensor([list(context_ids)], dtype=torch.long, device=model.device)  # (1, T)
    _recompute(model, cache, ids, torch.tensor(chosen, dtype=torch.long, device=model.device))
    return BlendResult(len(chosen))


def _recompute(model, cache, ids: torch.Tensor, positions: torch.Tensor) -> None:
    """Run the tokens at `positions` through the model at those positions, attending to the
    cache (less their own stale slots) and to each other causally; keep their fresh KV."""
    total = ids.shape[1]
    selected = torch.zeros(total, dtype=torch.bool, device=ids.device)
    selected[positions] = True
    slots = torch.arange(total, device=ids.device)
    stale_ok = (slots[None, :] <= positions[:, None]) & ~selected[None, :]  # (S, T): older, not being replaced
    fresh_ok = positions[None, :] <= positions[:, None]  # (S, S): causal among the recomputed
    mask = torch.cat([stale_ok, fresh_ok], dim=1)[None, None]  # (1, 1, S, T + S), True = attend
    model(input_ids=ids[:, positions], position_ids=positions[None], attention_mask=mask, cache=cache,
          use_cache=True, logits_to_keep=1)
    kv.move_appended(cache, total, positions)
