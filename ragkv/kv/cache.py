"""The only place that converts entries to and from transformers' cache.

An entry (`ragkv.kv.entry.Entry`, one sequence of T tokens) holds, per group of layers of one
shape (`ragkv.kv.layout`), a canonical tensor `(L_g, 2, H, T, D)` (layers, key/value, KV
heads, tokens, head dim), or `(L_g, 1, H, T, Dk + Dv)` for keys and values of different widths
(latent attention), and, for a model with recurrent layers, their state after the last token.
Entries that follow each other in a prompt concatenate along dim 3 (tokens), the state being
the last one's. Every attention layer keeps every token, sliding-window layers too (the sliding
mask bounds their attention; see `ragkv.kv.layout`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from transformers import DynamicCache
from transformers.cache_utils import DummyLayer, DynamicLayer, LinearAttentionLayer

from ragkv.core.errors import ModelError
from ragkv.kv.entry import Entry, State
from ragkv.kv.layout import TOKEN_DIM, KVLayout, join, layout_of, model_class, read_layout, refuse_unknown

__all__ = ["TOKEN_DIM", "Entry", "KVLayout", "layout_of"]


class Deferred(Protocol):
    """An entry of one group and no state, not in memory yet, that writes itself into a cache's
    buffers (`ragkv.kv.codec.StoredKV`: read from the store straight into them)."""

    shape: torch.Size  # the group's canonical `(L, 2, H, T, D)`
    dtype: torch.dtype
    device: torch.device
    num_tokens: int
    state: None

    def fill(self, layers: Sequence[tuple[torch.Tensor, torch.Tensor]], start: int) -> None: ...

    def entry(self) -> Entry: ...


Part = Entry | Deferred  # what a cache is built from


def num_tokens(part: Part) -> int:
    return part.num_tokens


def whole(part: Part) -> Entry:
    """`part` as an entry in memory (a deferred one read into new memory)."""
    return part if isinstance(part, Entry) else part.entry()


def to_cache(parts: Sequence[Part], config, batch_size: int = 1) -> DynamicCache:
    """Build a `DynamicCache` holding `parts` one after another along the tokens.

    parts: entries (or `Deferred` ones that write themselves in), each of every layer group of
    the model's layout; with recurrent layers, the last one carries the state the cache ends
    with. Returns a cache with per-layer keys and values of shape `(batch_size, H, sum T_i, D)`
    (and the state, repeated over the batch), written with one copy per part into new memory
    (later forwards that grow the cache never touch `parts`). Fresh memory, not a reused buffer,
    on purpose: measured on CPU, a reused buffer made the question prefill ~6% slower (the
    allocator then cannot recycle the previous request's freed pages).
    """
    cache = growing_cache(config)
    layout: KVLayout = cache.kv_layout
    _check_parts(parts, layout)
    total = sum(p.num_tokens for p in parts)
    dtype, device = parts[0].dtype, parts[0].device
    capacity = total + spare_columns(total)
    for index, group in enumerate(layout.groups):
        buffers = [  # (B, H, capacity, Dk) keys and (B, H, capacity, Dv) values per layer of the group
            (
                torch.empty((batch_size, group.num_heads, capacity, group.key_dim), dtype=dtype, device=device),
                torch.empty((batch_size, group.num_heads, capacity, group.value_dim), dtype=dtype, device=device),
            )
            for _ in group.layers
        ]
        start = 0
        for part in parts:
            if isinstance(part, Entry):
                stop = start + part.num_tokens
                for (keys, values), layer_kv in zip(buffers, part.groups[index], strict=True):
                    layer_keys, layer_values = group.split(layer_kv)  # (H, T_i, Dk), (H, T_i, Dv)
                    keys[:, :, start:stop] = layer_keys  # broadcast over the batch
                    values[:, :, start:stop] = layer_values
            else:
                part.fill(buffers, start)
            start += part.num_tokens
        for layer, (keys, values) in zip(group.layers, buffers, strict=True):
            cache.layers[layer].hold(keys, values, total)
    if layout.has_state:
        seed_state(cache, [parts[-1].state] * batch_size, total)
    return cache


def _check_parts(parts: Sequence[Part], layout: KVLayout) -> None:
    """ModelError when `parts` are not of `layout` (another model's KV); ValueError when a
    stateful layout's last part has no state (a slice: an internal error)."""
    first = parts[0]
    groups = first.groups if isinstance(first, Entry) else (first,)
    shapes = [tuple(g.shape[:3]) for g in groups]
    expected = [group.shape(0)[:3] for group in layout.groups]
    if shapes != expected:
        raise ModelError(f"stored KV has layers of shapes {shapes}; this model's are {expected}")
    if layout.has_state and parts[-1].state is None:
        raise ValueError("the last part of a cache for a model with recurrent layers must carry its state")


def append(cache: DynamicCache, parts: Sequence[Entry]) -> None:
    """Append `parts` to `cache` (batch 1) along the tokens, as a forward over their tokens
    would have: the KV grows, the state becomes the last part's."""
    layout: KVLayout = cache.kv_layout  # set by growing_cache
    for part in parts:
        for group, group_kv in zip(layout.groups, part.groups, strict=True):
            for layer, layer_kv in zip(group.layers, group_kv, strict=True):
                keys, values = group.split(layer_kv)  # (H, T_i, Dk), (H, T_i, Dv)
                cache.layers[layer].update(keys[None], values[None])
    if layout.has_state and parts:
        seed_state(cache, [parts[-1].state], num_cached(cache))


def left_padded(rows: Sequence[Sequence[Entry]], config) -> tuple[DynamicCache, list[int]]:
    """A batch cache with one row per entry of `rows` (each row: entries, one after another),
    right-aligned: row i's tokens fill the last of its columns and the zeros before them are
    padding, for a mask to hide; each row's state is its last entry's. Returns the cache (new
    memory, with room to append) and each row's number of real tokens. A forward over it then
    appends the same new tokens to every row, as a batch of questions over different contexts
    does."""
    lengths = [sum(part.num_tokens for part in parts) for parts in rows]
    width = max(lengths)
    first = rows[0][0].groups[0]
    cache = growing_cache(config)
    layout: KVLayout = cache.kv_layout
    for index, group in enumerate(layout.groups):
        for position, layer_index in enumerate(group.layers):
            keys, values = (  # (B, H, capacity, Dk) and (B, H, capacity, Dv): pads stay finite
                first.new_zeros((len(rows), group.num_heads, width + spare_columns(width), dim))
                for dim in (group.key_dim, group.value_dim)
            )
            for row, parts in enumerate(rows):
                start = width - lengths[row]
                for part in parts:
                    stop = start + part.num_tokens
                    keys[row, :, start:stop], values[row, :, start:stop] = group.split(part.groups[index][position])
                    start = stop
            cache.layers[layer_index].hold(keys, values, width)
    if layout.has_state:
        seed_state(cache, [parts[-1].state for parts in rows], width)
    return cache, lengths


def from_cache(cache: DynamicCache, row: int = 0, start: int = 0, stop: int | None = None) -> Entry:
    """Copy tokens `[start:stop)` of batch row `row` out of `cache` as an entry (new memory, safe
    to keep after the cache is reused or freed), with the row's state when `stop` is the end
    (None or the cache's length): a state is the cache's after its last token. `cache` is one
    `growing_cache` made, or any filled transformers cache (its layout read off it)."""
    layout: KVLayout = getattr(cache, "kv_layout", None) or read_layout(cache, "this cache")
    groups = []
    for group in layout.groups:
        keys = [cache.layers[i].keys[row, :, start:stop] for i in group.layers]  # each (H, T, Dk)
        values = [cache.layers[i].values[row, :, start:stop] for i in group.layers]  # each (H, T, Dv)
        groups.append(join(keys, values))  # new memory
    at_end = stop is None or stop >= num_cached(cache)
    state = state_of(cache, row) if layout.has_state and at_end else None
    return Entry(tuple(groups), state)


def state_of(cache: DynamicCache, row: int = 0) -> State:
    """Batch row `row`'s recurrent state in `cache` (copies, by `StateSpec.name`)."""
    layout: KVLayout = getattr(cache, "kv_layout", None) or read_layout(cache, "this cache")
    state = {}
    for spec in layout.states:
        layer = cache.layers[spec.layer]
        held = layer.conv_states if spec.kind == "conv" else layer.recurrent_states
        state[spec.name] = held[spec.index][row].clone()
    return state


def seed_state(cache: DynamicCache, states: Sequence[State | None], length: int) -> None:
    """Give `cache`'s recurrent layers the state of each batch row (`states`, one per row, as
    `state_of` returns them), as if a forward over `length` tokens had left it: what the next
    forward continues from."""
    layout: KVLayout = cache.kv_layout
    for spec in layout.states:
        rows = []
        for state in states:
            if state is None:
                raise ValueError("a cache for a model with recurrent layers needs every row's state")
            rows.append(state[spec.name])
        tensor = torch.stack(rows)  # (B, *spec.shape)
        layer = cache.layers[spec.layer]
        if spec.kind == "conv":
            layer.lazy_initialization(conv_states=tensor, state_idx=spec.index)
            layer.conv_states[spec.index].copy_(tensor)
        else:
            layer.lazy_initialization(recurrent_states=tensor, state_idx=spec.index)
            layer.recurrent_states[spec.index].copy_(tensor)
        layer.has_previous_state[spec.index] = True
        layer.cumulative_length_linear.fill_(length)


def to_cache_empty(config) -> DynamicCache:
    """An empty cache for a full prefill (its layers append in place, as `to_cache`'s do, so
    both paths run the same attention over the same memory layout)."""
    return growing_cache(config)


def num_cached(cache) -> int:
    """Tokens `cache` holds (its attention layers' length; a layer without KV counts its own)."""
    for layer in cache.layers:
        if isinstance(layer, DynamicLayer):
            return layer.get_seq_length()
    for layer in cache.layers:
        if isinstance(layer, LinearAttentionLayer):
            return int(layer.cumulative_length_linear)
    return 0


def crop(cache, num_tokens: int, state: State | None = None) -> None:
    """Keep only the first `num_tokens` tokens of every layer. A recurrent state cannot be cut
    back: for a model with recurrent layers, `state` is the state after those tokens (taken
    when the cache held them: `state_of`; none for 0 tokens), and becomes the cache's."""
    layout: KVLayout = cache.kv_layout
    if layout.has_state and state is None and num_tokens > 0:
        raise ValueError("a cache with recurrent state is cut back only to a point whose state was kept")
    extra = num_cached(cache) - num_tokens
    if extra > 0:
        for layer in cache.layers:
            if isinstance(layer, DynamicLayer):
                DynamicLayer.crop(layer, -extra)  # transformers 5: negative = remove that many from the end
    if not layout.has_state:
        return
    if num_tokens == 0:  # back to the start: no state at all
        for layer in cache.layers:
            if isinstance(layer, LinearAttentionLayer):
                LinearAttentionLayer.reset(layer)
    else:
        seed_state(cache, [state], num_tokens)


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


class GrowingHybridLayer(LinearAttentionLayer, GrowingLayer):
    """A layer that keeps a recurrent state beside attention KV (Falcon-H1's Mamba beside its
    attention): transformers' linear-attention state, and keys and values that grow in place
    (`GrowingLayer`), as transformers' `LinearAttentionAndFullAttentionLayer` joins the two."""

    is_compileable = False

    def __init__(self, **kwargs):
        GrowingLayer.__init__(self)
        LinearAttentionLayer.__init__(self)

    def lazy_initialization(self, *args, **kwargs) -> None:
        if len(args) == 2 and not kwargs:  # from `update`: keys and values
            DynamicLayer.lazy_initialization(self, *args)
        elif not args:  # from the state updates: conv or recurrent states, by keyword
            LinearAttentionLayer.lazy_initialization(self, **kwargs)

    def get_seq_length(self) -> int:
        return DynamicLayer.get_seq_length(self)

    def crop(self, tokens_to_remove: int) -> None:
        DynamicLayer.crop(self, tokens_to_remove)  # the state: `ragkv.kv.cache.crop` reseeds it


def growing_cache(config) -> DynamicCache:
    """An empty cache whose attention layers append in place (`GrowingLayer`), sliding-window
    layers included: they keep every token, and the sliding mask (absolute positions) bounds
    what each query attends to, as in a full prefill. Recurrent layers keep transformers' own
    state layers; a layer with both gets a `GrowingHybridLayer`; a layer that caches nothing
    stays empty. `cache.kv_layout` describes it. Raises ModelError for layers of another kind."""
    layout = layout_of(config)
    cache = DynamicCache(config=config)
    refuse_unknown(cache, model_class(config))
    kv_layers = {layer for group in layout.groups for layer in group.layers}
    stateful = {spec.layer for spec in layout.states}
    cache.layers = [
        _growing_layer(index in kv_layers, index in stateful or isinstance(layer, LinearAttentionLayer))
        for index, layer in enumerate(cache.layers)
    ]
    cache.kv_layout = layout
    return cache


def _growing_layer(has_kv: bool, has_state: bool):
    if has_kv and has_state:
        return GrowingHybridLayer()
    if has_state:
        return LinearAttentionLayer()
    return GrowingLayer() if has_kv else DummyLayer()
