"""Selective recompute (approximate), CacheBlend-style (`blend`), EPIC-style
(`recompute_starts`) and question-aware (`attended_recompute`, after ProphetKV). CacheBlend:
after chunks' stored KV are placed one after another (`concat`), recompute the KV of the share
of context tokens that deviate most from a full prefill, so that cross-chunk attention is partly restored.

Selection follows CacheBlend's gradual filtering. The first layers are cheap to compute exactly
for every token (2 of L layers): the tokens whose layer-1 values differ most from the
concatenated cache start the selection, twice the share. Then one layer at a time, the
selected tokens run at their own positions, attending to the (mixed) cache, and their fresh KV
replaces the stale one; after each layer the tokens whose values moved most stay selected,
narrowing linearly to the share at the last layer. So the selection follows the deviation
where it grows (deeper layers), not only where it starts. Measured against selecting once at
layer 1 and recomputing those tokens through every layer, at equal time to first token it
agreed more with a full prefill, with lower first-token KL (benchmarks/results/passages.md).
With ratio 1.0 every layer recomputes every token: a full recompute of the context.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ragkv.kv import cache as kv
from ragkv.modes.attention_probe import Probe, probed_forward

SELECTION_LAYERS = 2  # layer 0 is exact after re-rotation; layer 1 is the first that deviates


@dataclass(frozen=True)
class BlendResult:
    num_recomputed: int


def _first_layers_exact(model, ids: torch.Tensor):
    """Run the first SELECTION_LAYERS decoder layers over all of `ids` (1, T), causally from
    position 0: (a new cache holding those layers' exact KV, their output (1, T, hidden))."""
    inner, cache = model.model, kv.to_cache_empty(model.config)
    total = ids.shape[1]
    position_ids = torch.arange(total, device=ids.device)[None]  # (1, T)
    causal = torch.ones(total, total, dtype=torch.bool, device=ids.device).tril()[None, None]  # (1, 1, T, T)
    hidden = inner.embed_tokens(ids)
    rotation = inner.rotary_emb(hidden, position_ids=position_ids)
    for layer in inner.layers[:SELECTION_LAYERS]:
        hidden = layer(
            hidden,
            attention_mask=causal,
            position_ids=position_ids,
            position_embeddings=rotation,
            cache=cache,
            use_cache=True,
        )
    return cache, hidden


def _share(ratio: float, available: int) -> int:
    """How many of `available` tokens `ratio` recomputes: at least one when ratio > 0."""
    return min(available, max(1, round(ratio * available))) if ratio > 0 and available > 0 else 0


@torch.inference_mode()
def blend(model, cache, context_ids: Sequence[int], start: int, ratio: float) -> BlendResult:
    """Recompute, in place, the KV of the `ratio` share of `context_ids[start:]` that deviates
    most, narrowing layer by layer (module docstring). `cache` holds approximate KV for all of
    `context_ids` (batch 1). `num_recomputed`: the mean number of tokens recomputed per layer
    past the selection layers (about 1.5x the share's)."""
    total = len(context_ids)
    count = _share(ratio, total - start)
    if count == 0:
        return BlendResult(0)
    ids = torch.tensor([list(context_ids)], dtype=torch.long, device=model.device)  # (1, T)
    exact, hidden = _first_layers_exact(model, ids)
    kv.overwrite_layers(cache, exact, SELECTION_LAYERS)
    counts = _narrowing(count, total - start, model.config.num_hidden_layers - SELECTION_LAYERS)
    if not counts:  # a model of only selection layers: every layer is exact already
        return BlendResult(total - start)
    deviation = kv.layer_deviation(cache, exact, SELECTION_LAYERS - 1, start)  # (T - start,)
    chosen = (deviation.topk(counts[0]).indices + start).sort().values  # (S0,) context positions
    _recompute_narrowing(model, cache, total, chosen, hidden[:, chosen], counts)
    return BlendResult(round(sum(counts) / len(counts)))


def _narrowing(count: int, available: int, num_layers: int) -> list[int]:
    """Tokens recomputed at each of `num_layers` layers: from twice `count` (at most
    `available`) down to `count` at the last, linearly. `count == available` keeps all."""
    first = min(available, 2 * count)
    if num_layers <= 1:
        return [count] * num_layers
    return [round(first + (count - first) * layer / (num_layers - 1)) for layer in range(num_layers)]


def _recompute_narrowing(
    model, cache, total: int, positions: torch.Tensor, hidden: torch.Tensor, counts: Sequence[int]
) -> None:
    """Run layers SELECTION_LAYERS.. one at a time over the tokens at `positions`, starting
    from their exact input `hidden` (1, S, hidden); after each layer keep those whose fresh
    values moved most from the stale ones, `counts[i]` at layer i (past the selection layers)."""
    inner = model.model
    for offset, layer in enumerate(inner.layers[SELECTION_LAYERS:]):
        position_ids = positions[None]  # (1, S)
        hidden = layer(
            hidden,
            attention_mask=_recompute_mask(positions, total),
            position_ids=position_ids,
            position_embeddings=inner.rotary_emb(hidden, position_ids=position_ids),
            cache=cache,
            use_cache=True,
        )
        values = cache.layers[SELECTION_LAYERS + offset].values[0]  # (H, T + S, D)
        moved = (values[:, total:].float() - values[:, positions].float()).norm(dim=(0, 2))  # (S,)
        kv.move_appended_layer(cache.layers[SELECTION_LAYERS + offset], total, positions)
        if offset + 1 < len(counts) and counts[offset + 1] < positions.numel():
            keep = moved.topk(counts[offset + 1]).indices.sort().values
            positions, hidden = positions[keep], hidden[:, keep]


@torch.inference_mode()
def recompute_starts(
    model, cache, context_ids: Sequence[int], starts: Sequence[int], lengths: Sequence[int], ratio: float
) -> BlendResult:
    """EPIC/LegoLink-style (approximate): recompute, in place, the first `ratio` share of each
    passage that starts at `starts[i]` and runs `lengths[i]` tokens (at least one token each
    when ratio > 0). A passage computed on its own learned to treat its own first tokens as the
    attention sink; recomputed at their real place, attending to everything before them, they
    stop drawing attention the full prefill would not give them."""
    if ratio <= 0 or not starts:
        return BlendResult(0)
    chosen = [
        p for start, length in zip(starts, lengths, strict=False) for p in range(start, start + _share(ratio, length))
    ]
    ids = torch.tensor([list(context_ids)], dtype=torch.long, device=model.device)  # (1, T)
    _recompute(model, cache, ids, torch.tensor(chosen, dtype=torch.long, device=model.device))
    return BlendResult(len(chosen))


@dataclass(frozen=True)
class Recompute:
    """Context tokens chosen for recompute, left to the prompt's own prefill (`prefill`): one
    forward runs them at their positions, and the tokens after the context with them, attending
    to their fresh KV. The same numbers as recomputing first and prefilling after (up to the
    order of float sums), in one forward instead of two."""

    positions: torch.Tensor  # (S,) sorted context positions
    ids: torch.Tensor  # (S,) their token ids
    num_context: int  # the tokens the cache holds: the context

    @torch.inference_mode()
    def prefill(self, model, input_ids: Sequence[int], cache) -> torch.Tensor:
        """Recompute the chosen tokens in place and prefill `input_ids` after the context, in one
        forward over `cache` (which holds exactly the context); the last position's logits `(V,)`."""
        total, new = self.num_context, torch.tensor(list(input_ids), dtype=torch.long, device=model.device)
        assert kv.num_cached(cache) == total, "a recompute runs with the first prefill after its context"
        after = torch.arange(total, total + len(new), device=model.device)
        out = model(
            input_ids=torch.cat([self.ids, new])[None],
            position_ids=torch.cat([self.positions, after])[None],
            attention_mask=_recompute_mask(self.positions, total, len(new)),
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        kv.settle_recomputed(cache, total, self.positions, len(new))
        return out.logits[0, -1]


@torch.inference_mode()
def attended_recompute(
    model, cache, context_ids: Sequence[int], question_ids: Sequence[int], start: int, ratio: float
) -> Recompute | None:
    """Question-aware (approximate, after ProphetKV): run the question over the concatenated
    cache, measure the attention it pays each context token after `start` (summed over layers,
    heads and question tokens), and choose the `ratio` share it attends to most, to be
    recomputed with the prompt's prefill (`Recompute`). The probe's own KV of the question
    is dropped: it saw the context before the recompute. None when there is nothing to choose."""
    total = len(context_ids)
    count = _share(ratio, total - start)
    if count == 0 or not question_ids:
        return None
    probe = Probe(total)
    question = torch.tensor([list(question_ids)], dtype=torch.long, device=model.device)  # (1, Q)
    probed_forward(model, probe, input_ids=question, cache=cache, use_cache=True, logits_to_keep=1)
    kv.crop(cache, total)
    assert probe.mass is not None  # the forward above ran the probe
    chosen = (probe.mass[start:].topk(count).indices + start).sort().values  # (S,) context positions
    ids = torch.tensor(list(context_ids), dtype=torch.long, device=model.device)[chosen]
    return Recompute(chosen, ids, total)


def _recompute(model, cache, ids: torch.Tensor, positions: torch.Tensor) -> None:
    """Run the tokens at `positions` through the model at those positions, attending to the
    cache (less their own stale slots) and to each other causally; keep their fresh KV."""
    total = ids.shape[1]
    model(
        input_ids=ids[:, positions],
        position_ids=positions[None],
        attention_mask=_recompute_mask(positions, total),
        cache=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    kv.move_appended(cache, total, positions)


def _recompute_mask(positions: torch.Tensor, total: int, num_after: int = 0) -> torch.Tensor:
    """(1, 1, S + A, T + S + A), True = attend: the tokens at `positions`, appended after a
    cache of `total`, see the cache's older slots less their own stale ones, and each other
    causally; the `num_after` tokens after them (A: those after the context) see every slot
    but the stale ones, every fresh one, and each other causally."""
    device = positions.device
    selected = torch.zeros(total, dtype=torch.bool, device=device)
    selected[positions] = True
    slots = torch.arange(total, device=device)
    stale_ok = (slots[None, :] <= positions[:, None]) & ~selected[None, :]  # (S, T): older, not being replaced
    fresh_ok = positions[None, :] <= positions[:, None]  # (S, S): causal among the recomputed
    count = positions.numel()
    recomputed = torch.cat([stale_ok, fresh_ok, torch.zeros(count, num_after, dtype=torch.bool, device=device)], 1)
    after = torch.cat(
        [
            (~selected)[None, :].expand(num_after, total),  # (A, T): all but the stale
            torch.ones(num_after, count, dtype=torch.bool, device=device),  # (A, S): every fresh one
            torch.ones(num_after, num_after, dtype=torch.bool, device=device).tril(),  # (A, A): causal
        ],
        dim=1,
    )
    return torch.cat([recomputed, after], dim=0)[None, None]
