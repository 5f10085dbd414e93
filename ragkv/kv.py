"""The one canonical KV layout, and the only place that converts to and from transformers' cache.

Canonical layout of one entry (one sequence of T tokens): a tensor of shape
`(L, 2, H, T, D)`: layers, key/value, KV heads, tokens, head dim. Entries that follow each
other in a prompt concatenate along dim 3 (tokens).
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ragkv.errors import ModelError

KV_LAYOUT = "L2HTD"
TOKEN_DIM = 3


def num_tokens(kv: torch.Tensor) -> int:
    return kv.shape[TOKEN_DIM]


def to_cache(parts: Sequence[torch.Tensor], config, batch_size: int = 1) -> DynamicCache:
    """Build a `DynamicCache` holding `parts` one after another along the tokens.

    parts: canonical `(L, 2, H, T_i, D)` tensors. Returns a cache with per-layer keys and
    values of shape `(batch_size, H, sum T_i, D)`, written with one copy per part into new
    memory (later forwards that grow the cache never touch `parts`). Fresh memory, not a
    reused buffer, on purpose: measured on CPU, a reused buffer made the question prefill
    ~6% slower (the allocator then cannot recycle the previous request's freed pages).
    """
    cache = DynamicCache(config=config)
    if len(cache.layers) != parts[0].shape[0] or any(type(layer) is not DynamicLayer for layer in cache.layers):
        return _to_cache_generic(parts, config, batch_size)  # sliding-window or hybrid layers
    _, _, heads, _, head_dim = parts[0].shape
    total = sum(p.shape[TOKEN_DIM] for p in parts)
    for index, layer in enumerate(cache.layers):
        shape = (batch_size, heads, total, head_dim)
        keys = torch.empty(shape, dtype=parts[0].dtype, device=parts[0].device)  # (B, H, T, D)
        values = torch.empty(shape, dtype=parts[0].dtype, device=parts[0].device)
        start = 0
        for part in parts:
            stop = start + part.shape[TOKEN_DIM]
            keys[:, :, start:stop] = part[index, 0]  # (H, T_i, D) broadcast over the batch
            values[:, :, start:stop] = part[index, 1]
            start = stop
        # DynamicLayer's own update would copy once more (a cat onto an empty tensor).
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
    return cache


def _to_cache_generic(parts: Sequence[torch.Tensor], config, batch_size: int) -> DynamicCache:
    num_layers = parts[0].shape[0]
    layers = []
    for layer in range(num_layers):
        keys = torch.cat([p[layer, 0] for p in parts], dim=1)  # (H, T, D)
        values = torch.cat([p[layer, 1] for p in parts], dim=1)  # (H, T, D)
        layers.append(
            (
                keys.unsqueeze(0).expand(batch_size, -1, -1, -1),  # (B, H, T, D)
                values.unsqueeze(0).expand(batch_size, -1, -1, -1),
            )
        )
    return DynamicCache(layers, config=config)


def from_cache(cache: DynamicCache, row: int = 0, start: int = 0, stop: int | None = None) -> torch.Tensor:
    """Copy tokens `[start:stop)` of batch row `row` out of `cache` as a canonical tensor.

    Returns a new contiguous `(L, 2, H, stop - start, D)` tensor (safe to keep after the
    cache is reused or freed).
    """
    keys = [layer.keys[row, :, start:stop] for layer in cache.layers]  # each (H, T, D)
    values = [layer.values[row, :, start:stop] for layer in cache.layers]
    stacked = torch.stack([torch.stack(kv) for kv in zip(keys, values)])  # (L, 2, H, T, D)
    return stacked.contiguous()


def check_layout(cache: DynamicCache) -> None:
    """Refuse caches whose layers are not plain `(B, H, T, D)` key/value tensors."""
    for layer in cache.layers:
        if getattr(layer, "keys", None) is None or layer.keys.dim() != 4:
            raise ModelError(
                f"this model's cache has {type(layer).__name__} layers; ragkv stores plain (batch, heads, tokens, "
                "head_dim) keys and values: use a model with standard attention (e.g. Llama, Qwen2, Mistral)"
            )


def to_cache_empty(config) -> DynamicCache:
    """An empty cache for a full prefill."""
    return DynamicCache(config=config)


def num_cached(cache) -> int:
    return cache.get_seq_length()


def crop(cache, num_tokens: int) -> None:
    """Keep only the first `num_tokens` tokens of every layer."""
    extra = cache.get_seq_length() - num_tokens
    if extra > 0:
        cache.crop(-extra)  # transformers 5: a negative argument removes that many from the end


def overwrite_layers(cache, exact: DynamicCache, num_layers: int) -> None:
    """Replace the first `num_layers` layers of `cache` with those of `exact` (same length)."""
    for layer in range(num_layers):
        cache.layers[layer].keys.copy_(exact.layers[layer].keys)
        cache.layers[layer].values.copy_(exact.layers[layer].values)


def move_appended(cache, num_kept: int, positions: torch.Tensor) -> None:
    """The tokens appended after the first `num_kept` are fresh versions of the tokens at
    `positions` (sorted, all < num_kept): write them there, then drop the appended copies."""
    for layer in cache.layers:
        layer.keys[:, :, positions] = layer.keys[:, :, num_kept:]
        layer.values[:, :, positions] = layer.values[:, :, num_kept:]
    crop(cache, num_kept)


def layer_deviation(cache, exact: DynamicCache, layer: int, start: int) -> torch.Tensor:
    """Per token from `start` on: how far `cache`'s values at `layer` are from `exact`'s, `(T,)`."""
    approx = cache.layers[layer].values[0, :, start:].float()  # (H, T, D)
    truth = exact.layers[layer].values[0, :, start:].float()
    return (approx - truth).norm(dim=(0, 2))


def repeat_batch(cache, batch_size: int) -> None:
    """Turn a batch-1 cache into `batch_size` identical rows, in place."""
    cache.batch_repeat_interleave(batch_size)


class RaggedBatch:
    """Sequences of different lengths decoded together (continuous batching): one cache of B
    rows, each row's tokens right-aligned (left-padded to the longest). A padding mask hides
    the pads and each row's positions are its own, so every row computes what it would alone.

    Rows join (`add`, a copy of the row's KV), advance together (`step`) and leave (`remove`,
    a copy of the remaining rows; all-pad leading columns are dropped). Padded width costs
    attention work; the engine bounds rows x width (its token budget)."""

    def __init__(self, config):
        self.config = config
        self.cache: DynamicCache | None = None
        self.lengths: list[int] = []  # real tokens per row

    @property
    def num_rows(self) -> int:
        return len(self.lengths)

    @property
    def width(self) -> int:
        return self.cache.get_seq_length() if self.cache is not None else 0

    def add(self, single: DynamicCache) -> int:
        """Append the batch-1 `single` as a new row (copied; `single` may be reused after).
        Returns the row's index."""
        check_layout(single)
        length = single.get_seq_length()
        if self.cache is None:
            self.cache = DynamicCache(config=self.config)
            for batch_layer, row_layer in zip(self.cache.layers, single.layers):
                keys, values = row_layer.keys.clone(), row_layer.values.clone()  # (1, H, T, D)
                batch_layer.lazy_initialization(keys, values)
                batch_layer.keys, batch_layer.values = keys, values
            self.lengths = [length]
            return 0
        width = max(self.width, length)
        for batch_layer, row_layer in zip(self.cache.layers, single.layers):
            batch_layer.keys = _append_row(batch_layer.keys, row_layer.keys, width)
            batch_layer.values = _append_row(batch_layer.values, row_layer.values, width)
        self.lengths.append(length)
        return self.num_rows - 1

    def remove(self, rows: Sequence[int]) -> None:
        """Drop `rows`; the others keep their order."""
        gone = set(rows)
        keep = [i for i in range(self.num_rows) if i not in gone]
        self.lengths = [self.lengths[i] for i in keep]
        if not keep:
            self.cache = None
            return
        trim = self.width - max(self.lengths)  # leading columns that are padding in every row left
        index = torch.tensor(keep, device=self.cache.layers[0].keys.device)
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(0, index)[:, :, trim:]  # (B', H, T', D)
            layer.values = layer.values.index_select(0, index)[:, :, trim:]

    def extract(self, row: int) -> DynamicCache:
        """Row `row`'s real tokens as a batch-1 cache of its own (new memory)."""
        start = self.width - self.lengths[row]
        parts = [torch.stack([layer.keys[row, :, start:], layer.values[row, :, start:]])  # (2, H, T, D)
                 for layer in self.cache.layers]
        return to_cache([torch.stack(parts)], self.config)  # (L, 2, H, T, D) copied into a new cache

    def step(self, model, tokens: Sequence[int]) -> torch.Tensor:
        """Feed one token per row; returns the next-token logits `(B, V)`. Grows every row by one."""
        device = model.device
        width = self.width
        lengths = torch.tensor(self.lengths)  # (B,)
        columns = torch.arange(width + 1)[None, :]  # (1, T + 1)
        mask = (columns >= (width - lengths)[:, None]).long()  # (B, T + 1): pads 0, real tokens and the new one 1
        ids = torch.tensor(list(tokens), dtype=torch.long)[:, None]  # (B, 1)
        out = model(input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=lengths[:, None].to(device),
                    cache=self.cache, use_cache=True, logits_to_keep=1)
        self.lengths = [n + 1 for n in self.lengths]
        return out.logits[:, -1]


def _append_row(batch: torch.Tensor, row: torch.Tensor, width: int) -> torch.Tensor:
    """batch `(B, H, T, D)` and row `(1, H, t, D)` -> `(B + 1, H, width, D)`, right-aligned."""
    rows, heads, old_width, dim = batch.shape
    out = batch.new_zeros((rows + 1, heads, width, dim))
    out[:rows, :, width - old_width:] = batch
    out[rows, :, width - row.shape[2]:] = row[0]
    return out
