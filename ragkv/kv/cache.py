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
from typing import Any, Protocol

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
    capacity = total + _spare(total)
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
            first.new_zeros((len(rows), layout.num_heads, width + _spare(width), dim))
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
            self._reserve(key_states, value_states, key_states.shape[2] + _spare(key_states.shape[2]))
            return self.keys, self.values
        length, new = self.keys.shape[2], key_states.shape[2]
        if self._buffers is None or not self._is_view() or length + new > self._buffers[0].shape[2]:
            self._reserve(self.keys, self.values, length + new + _spare(length + new))
        assert self._buffers is not None  # _reserve holds new ones
        keys, values = self._buffers
        keys[:, :, length : length + new] = key_states
        values[:, :, length : length + new] = value_states
        self.keys, self.values = keys[:, :, : length + new], values[:, :, : length + new]
        return self.keys, self.values


def _spare(length: int) -> int:
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


class SlotLayer(DynamicLayer):
    """One layer of a `RaggedBatch`: buffers of `(row capacity, H, token capacity, D)`, each row's
    tokens from column 0 (left-aligned). `keys`/`values` view the active rows and the longest
    row's columns; `update` writes each row's one new token at that row's own column
    (`write_at`), so rows of different lengths grow in place, without copying the batch."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        self.write_at: torch.Tensor | None = None  # (B,) the column each row's next token goes to

    def show(self, rows: int, width: int) -> None:
        """Point `keys`/`values` at the first `rows` rows and `width` columns of the buffers."""
        assert self.buffers is not None  # RaggedBatch reserves them before any row is shown
        self.keys, self.values = (b[:rows, :, :width] for b in self.buffers)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        rows = key_states.shape[0]
        index = torch.arange(rows, device=key_states.device)
        assert self.buffers is not None  # RaggedBatch reserves them before any row decodes
        keys, values = self.buffers
        keys[index, :, self.write_at] = key_states[:, :, 0]  # (B, H, D) one token per row
        values[index, :, self.write_at] = value_states[:, :, 0]
        self.show(rows, self.keys.shape[2] + 1)
        return self.keys, self.values


class RaggedBatch:
    """Sequences of different lengths decoded together (continuous batching). Each row holds
    its own tokens from column 0; a padding mask hides the columns past a row's length and
    each row's positions are its own, so every row computes what it would alone (in float32
    the same tokens; tested).

    Rows live in slots of preallocated buffers with spare rows and columns. Joining (`add`)
    copies the new row's KV only; leaving (`remove`) moves the last row into the hole; a step
    writes one token per row in place. Nothing copies the whole batch except growing the
    buffers (amortised). Attention works over rows x the longest row; the engine bounds that
    (its token budget). Every method runs in inference mode: the buffers are inference
    tensors, whichever call made them."""

    def __init__(self, config):
        self.config = config
        self.cache: Any = None  # a DynamicCache of SlotLayers, made by the first `add`
        self.lengths: list[int] = []  # real tokens per row

    @property
    def num_rows(self) -> int:
        return len(self.lengths)

    @property
    def width(self) -> int:
        return max(self.lengths, default=0)

    def _capacity(self) -> tuple[int, int]:
        if self.cache is None:
            return 0, 0
        buffer = self.cache.layers[0].buffers[0]
        return buffer.shape[0], buffer.shape[2]

    def _reserve(self, rows: int, columns: int, like: DynamicCache) -> None:
        """Make room for `rows` rows of `columns` tokens (growing by a quarter or more)."""
        have_rows, have_columns = self._capacity()
        if rows <= have_rows and columns <= have_columns:
            return
        rows = have_rows if rows <= have_rows else max(rows, 2 * have_rows, 4)
        columns = have_columns if columns <= have_columns else columns + _spare(columns)
        if self.cache is None:
            self.cache = DynamicCache(config=self.config)
            self.cache.layers = [SlotLayer() for _ in self.cache.layers]
        for layer, model in zip(self.cache.layers, like.layers, strict=False):
            fresh = tuple(  # (rows, H, columns, Dk) keys and (rows, H, columns, Dv) values: pads stay finite
                t.new_zeros((rows, t.shape[1], columns, t.shape[3])) for t in (model.keys, model.values)
            )
            if layer.buffers is not None:
                for old, new in zip(layer.buffers, fresh, strict=False):
                    new[: self.num_rows, :, : self.width] = old[: self.num_rows, :, : self.width]
            else:
                DynamicLayer.lazy_initialization(layer, model.keys, model.values)
            layer.buffers = fresh

    def _show(self) -> None:
        for layer in self.cache.layers:
            layer.show(self.num_rows, self.width)

    @torch.inference_mode()
    def add(self, single: DynamicCache) -> int:
        """Append the batch-1 `single` as a new row (copied; `single` may be reused after).
        Returns the row's index."""
        length = single.get_seq_length()
        row = self.num_rows
        self._reserve(row + 1, max(self.width, length) + 1, single)
        for layer, source in zip(self.cache.layers, single.layers, strict=False):
            layer.buffers[0][row, :, :length] = source.keys[0]
            layer.buffers[1][row, :, :length] = source.values[0]
        self.lengths.append(length)
        self._show()
        return row

    @torch.inference_mode()
    def remove(self, rows: Sequence[int]) -> list[int]:
        """Drop `rows`. The last rows move into the holes; returns, for each row now in the
        batch, the index it had before."""
        gone = set(rows)
        order = list(range(self.num_rows))
        for hole in sorted(gone, reverse=True):
            last = len(order) - 1
            if hole != last:
                self._move(order[last], hole)
                order[hole] = order[last]
            order.pop()
        lengths = self.lengths
        self.lengths = [lengths[i] for i in order]
        if not order:
            self.cache = None
            return []
        self._show()
        return order

    def _move(self, source: int, target: int) -> None:
        length = self.lengths[source]
        for layer in self.cache.layers:
            for buffer in layer.buffers:
                buffer[target, :, :length] = buffer[source, :, :length]

    @torch.inference_mode()
    def extract(self, row: int) -> DynamicCache:
        """Row `row`'s real tokens as a batch-1 cache of its own (new memory)."""
        length = self.lengths[row]
        keys = [layer.buffers[0][row, :, :length] for layer in self.cache.layers]  # each (H, T, Dk)
        values = [layer.buffers[1][row, :, :length] for layer in self.cache.layers]  # each (H, T, Dv)
        return to_cache([join(keys, values)], self.config)  # copied into a new cache

    @torch.inference_mode()
    def step(self, model, tokens: Sequence[int]) -> torch.Tensor:
        """Feed one token per row; returns the next-token logits `(B, V)`. Grows every row by one."""
        device = model.device
        width = self.width
        self._reserve(self.num_rows, width + 1, self.cache)
        self._show()
        lengths = torch.tensor(self.lengths)  # (B,)
        columns = torch.arange(width + 1)[None, :]  # (1, T + 1)
        mask = (columns <= lengths[:, None]).long()  # (B, T + 1): the row's tokens and its new one 1, the rest 0
        write_at = lengths.to(device)
        for layer in self.cache.layers:
            layer.write_at = write_at
        ids = torch.tensor(list(tokens), dtype=torch.long)[:, None]  # (B, 1)
        out = model(
            input_ids=ids.to(device),
            attention_mask=_row_masks(model, mask.to(device), self.cache, write_at),
            position_ids=lengths[:, None].to(device),
            cache=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self.lengths = [n + 1 for n in self.lengths]
        return out.logits[:, -1]


def _row_masks(model, padding: torch.Tensor, cache, lengths: torch.Tensor):
    """The attention mask of a ragged step: `padding` `(B, T + 1)` (1 on each row's tokens and
    its new one) where every layer attends fully. Sliding layers need more: transformers places
    the window by the cache's width, shared by all rows, but row b's new token sits at column
    `lengths[b]` (its own position), so the window must end there. Returns the masks the model
    takes then: per layer type for models that mix them, else the sliding one."""
    config = model.config
    window = getattr(config.get_text_config(), "sliding_window", None)
    if window is None or all(w is None for w in layout_of(config).windows):
        return padding
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    def own_window(batch_idx, head_idx, q_idx, kv_idx):
        return kv_idx > lengths[batch_idx] - window  # with the padding: (length - window, length]

    shape = dict(
        config=config,
        inputs_embeds=torch.empty((padding.shape[0], 1, 1), dtype=model.dtype, device=padding.device),
        attention_mask=padding,
        cache=cache,
        position_ids=lengths[:, None],
    )
    sliding = create_sliding_window_causal_mask(**shape, or_mask_function=own_window)
    if getattr(config.get_text_config(), "layer_types", None) is None:
        return sliding  # every layer slides (Mistral): the model takes one mask
    return {"full_attention": create_causal_mask(**shape), "sliding_attention": sliding}
