"""The only place that converts canonical KV to and from transformers' cache.

Canonical layout of one entry (one sequence of T tokens), described in `ragkv.kv.layout`: a
tensor of shape `(L, 2, H, T, D)` (layers, key/value, KV heads, tokens, head dim), or
`(L, 1, H, T, Dk + Dv)` for models whose keys and values differ in width (latent attention).
Entries that follow each other in a prompt concatenate along dim 3 (tokens). Every layer keeps
every token, sliding-window layers too (the sliding mask bounds their attention; see
`ragkv.kv.layout`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ragkv.core.errors import ModelError
from ragkv.kv.layout import TOKEN_DIM, KVLayout, join, layout_of, model_class, refuse_recurrent

__all__ = ["TOKEN_DIM", "KVLayout", "layout_of"]


class Deferred(Protocol):
    """KV of canonical `shape` `(L, 2, H, T, D)` not in memory yet, that writes itself into a
    cache's buffers (`ragkv.kv.codec.StoredKV`: read from the store straight into them)."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device

    def fill(self, layers: Sequence[tuple[torch.Tensor, torch.Tensor]], start: int) -> None: ...

    def tensor(self) -> torch.Tensor: ...


Part = torch.Tensor | Deferred  # what a cache is built from


def num_tokens(kv: Part) -> int:
    return kv.shape[TOKEN_DIM]


def to_cache(parts: Sequence[Part], config, batch_size: int = 1) -> DynamicCache:
    """Build a `DynamicCache` holding `parts` one after another along the tokens.

    parts: canonical `(L, 2, H, T_i, D)` tensors, or `Deferred` KV that writes itself in.
    Returns a cache with per-layer keys and values of shape `(batch_size, H, sum T_i, D)`,
    written with one copy per part into new memory (later forwards that grow the cache never
    touch `parts`). Fresh memory, not a reused buffer, on purpose: measured on CPU, a reused
    buffer made the question prefill ~6% slower (the allocator then cannot recycle the previous
    request's freed pages).
    """
    cache = growing_cache(config)
    layout = layout_of(config)
    if len(cache.layers) != parts[0].shape[0]:
        raise ModelError(f"stored KV has {parts[0].shape[0]} layers; this model has {len(cache.layers)}")
    total = sum(p.shape[TOKEN_DIM] for p in parts)
    dtype, device = parts[0].dtype, parts[0].device
    capacity = total + spare_columns(total)
    buffers = [  # (B, H, capacity, Dk) keys and (B, H, capacity, Dv) values per layer
        (
            torch.empty((batch_size, layout.num_heads, capacity, layout.key_dim), dtype=dtype, device=device),
            torch.empty((batch_size, layout.num_heads, capacity, layout.value_dim), dtype=dtype, device=device),
        )
        for _ in cache.layers
    ]
    start = 0
    for part in parts:
        if isinstance(part, torch.Tensor):
            stop = start + part.shape[TOKEN_DIM]
            for (keys, values), layer_kv in zip(buffers, part, strict=True):
                layer_keys, layer_values = layout.split(layer_kv)  # (H, T_i, Dk), (H, T_i, Dv)
                keys[:, :, start:stop] = layer_keys  # broadcast over the batch
                values[:, :, start:stop] = layer_values
        else:
            part.fill(buffers, start)
        start += part.shape[TOKEN_DIM]
    for layer, (keys, values) in zip(cache.layers, buffers, strict=True):
        layer.hold(keys, values, total)
    return cache


def append(cache: DynamicCache, parts: Sequence[torch.Tensor]) -> None:
    """Append canonical `(L, 2, H, T_i, D)` `parts` to `cache` (batch 1) along the tokens, as a
    forward over their tokens would have."""
    layout: KVLayout = cache.kv_layout  # set by growing_cache
    for part in parts:
        for index, layer_kv in enumerate(part):
            keys, values = layout.split(layer_kv)  # (H, T_i, Dk), (H, T_i, Dv)
            cache.layers[index].update(keys[None], values[None])


def whole(part: Part) -> torch.Tensor:
    """`part` as a tensor (a deferred one read into new memory)."""
    return part if isinstance(part, torch.Tensor) else part.tensor()


def left_padded(rows: Sequence[Sequence[torch.Tensor]], config) -> tuple[DynamicCache, list[int]]:
    """A batch cache with one row per entry of `rows` (each row: canonical `(L, 2, H, T_i, D)`
    parts, one after another), right-aligned: row i's tokens fill the last of its columns and
    the zeros before them are padding, for a mask to hide. Returns the cache (new memory, with
    room to append) and each row's number of real tokens. A forward over it then appends the
    same new tokens to every row, as a batch of questions over different contexts does."""
    lengths = [sum(part.shape[TOKEN_DIM] for part in parts) for parts in rows]
    width = max(lengths)
    first = rows[0][0]
    cache = growing_cache(config)
    layout = cache.kv_layout
    for index, layer in enumerate(cache.layers):
        keys, values = (  # (B, H, capacity, Dk) and (B, H, capacity, Dv): pads stay finite
            first.new_zeros((len(rows), layout.num_heads, width + spare_columns(width), dim))
            for dim in (layout.key_dim, layout.value_dim)
        )
        for row, parts in enumerate(rows):
            start = width - lengths[row]
            for part in parts:
                stop = start + part.shape[TOKEN_DIM]
                keys[row, :, start:stop], values[row, :, start:stop] = layout.split(part[index])  # (H, T_part, D*)
                start = stop
        layer.hold(keys, values, width)
    return cache, lengths


def from_cache(cache: DynamicCache, row: int = 0, start: int = 0, stop: int | None = None) -> torch.Tensor:
    """Copy tokens `[start:stop)` of batch row `row` out of `cache` as a canonical tensor.

    Returns a new contiguous `(L, 2, H, stop - start, D)` tensor (safe to keep after the
    cache is reused or freed).
    """
    keys = [layer.keys[row, :, start:stop] for layer in cache.layers]  # each (H, T, Dk)
    values = [layer.values[row, :, start:stop] for layer in cache.layers]  # each (H, T, Dv)
    return join(keys, values)  # new memory


def to_cache_empty(config) -> DynamicCache:
    """An empty cache for a full prefill (its layers append in place, as `to_cache`'s do, so
    both paths run the same attention over the same memory layout)."""
    return growing_cache(config)


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
        move_appended_layer(layer, num_kept, positions)


def move_appended_layer(layer, num_kept: int, positions: torch.Tensor) -> None:
    """`move_appended` for one layer of a cache."""
    layer.keys[:, :, positions] = layer.keys[:, :, num_kept:]
    layer.values[:, :, positions] = layer.values[:, :, num_kept:]
    layer.crop(num_kept - layer.keys.shape[2])  # transformers 5: negative = remove that many


def settle_recomputed(cache, num_kept: int, positions: torch.Tensor, num_after: int) -> None:
    """After a forward that appended fresh versions of the tokens at `positions` (sorted, all
    < num_kept) and then `num_after` new tokens: write the fresh versions over the stale ones
    and move the new tokens up to follow the first `num_kept`."""
    count = positions.numel()
    for layer in cache.layers:
        for tensor in (layer.keys, layer.values):
            tensor[:, :, positions] = tensor[:, :, num_kept : num_kept + count]
            tensor[:, :, num_kept : num_kept + num_after] = tensor[:, :, num_kept + count :].clone()
        if count:
            layer.crop(-count)  # transformers 5: negative = remove that many from the end


def layer_deviation(cache, exact: DynamicCache, layer: int, start: int) -> torch.Tensor:
    """Per token from `start` on: how far `cache`'s values at `layer` are from `exact`'s, `(T,)`."""
    approx = cache.layers[layer].values[0, :, start:].float()  # (H, T, D)
    truth = exact.layers[layer].values[0, :, start:].float()
    return (approx - truth).norm(dim=(0, 2))


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` that appends in place: keys and values live in buffers with spare
    tokens, and `keys`/`values` are views of their filled part. DynamicLayer's `update` copies
    the whole layer on every token (a `torch.cat`; on CPU with 8 rows of ~700 tokens the
    profiler put those copies at 42% of a decode step, the wall time fell ~8%). The views hold
    the same numbers, so a forward computes the same results as over a `DynamicLayer`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None  # (B, H, capacity, D) each

    def hold(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        """Take `keys`/`values` `(B, H, capacity, D)` as the buffers (not copied), the first
        `length` tokens filled."""
        if not self.is_initialized:
            DynamicLayer.lazy_initialization(self, keys, values)
        self._buffers = (keys, values)
        self.keys, self.values = keys[:, :, :length], values[:, :, :length]

    def _reserve(self, keys: torch.Tensor, values: torch.Tensor, capacity: int) -> None:
        """Hold copies of `keys`/`values` in new buffers of `capacity` tokens."""
        length = keys.shape[2]
        new_keys, new_values = (  # (B, H, capacity, Dk) and (B, H, capacity, Dv)
            t.new_empty((t.shape[0], t.shape[1], capacity, t.shape[3])) for t in (keys, values)
        )
        new_keys[:, :, :length] = keys
        new_values[:, :, :length] = values
        self.hold(new_keys, new_values, length)

    def _is_view(self) -> bool:
        """Whether `keys`/`values` still view the buffers (crop or batch selection reassign them)."""
        return (
            self._buffers is not None
            and self.keys.data_ptr() == self._buffers[0].data_ptr()
            and self.keys.shape[0] == self._buffers[0].shape[0]
            and self.values.data_ptr() == self._buffers[1].data_ptr()
            and self.keys.stride() == self._buffers[0].stride()
        )

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            DynamicLayer.lazy_initialization(self, key_states, value_states)
            self._reserve(key_states, value_states, key_states.shape[2] + spare_columns(key_states.shape[2]))
            return self.keys, self.values
        length, new = self.keys.shape[2], key_states.shape[2]
        if self._buffers is None or not self._is_view() or length + new > self._buffers[0].shape[2]:
            self._reserve(self.keys, self.values, length + new + spare_columns(length + new))
        assert self._buffers is not None  # _reserve holds new ones
        keys, values = self._buffers
        keys[:, :, length : length + new] = key_states
        values[:, :, length : length + new] = value_states
        self.keys, self.values = keys[:, :, : length + new], values[:, :, : length + new]
        return self.keys, self.values


def spare_columns(length: int) -> int:
    """Tokens of room kept past `length`: a quarter more, at least 64 (amortised growth)."""
    return max(64, length // 4)


def growing_cache(config) -> DynamicCache:
    """An empty cache whose attention layers append in place (`GrowingLayer`), sliding-window
    layers included: they keep every token, and the sliding mask (absolute positions) bounds
    what each query attends to, as in a full prefill. `cache.kv_layout` describes it. Raises
    ModelError for layers that keep anything else (recurrent state)."""
    layout = layout_of(config)
    cache = DynamicCache(config=config)
    refuse_recurrent(cache, model_class(config))
    cache.layers = [GrowingLayer() for _ in cache.layers]
    cache.kv_layout = layout
    return cache
