"""Continuous batching's cache: rows of different lengths decoded together, each in a slot of its
own (left-aligned, growing in place), with a padding mask and, for sliding-window layers, each
row's own window; a recurrent layer's state per row in a slot of its own."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DummyLayer, DynamicLayer, LinearAttentionLayer

from ragkv.kv import direct
from ragkv.kv.cache import GrowingHybridLayer, growing_cache, num_cached, spare_columns, to_cache
from ragkv.kv.entry import Entry
from ragkv.kv.layout import join, layout_of
from ragkv.kv.packed import Packing, attending_packed


class SlotLayer(DynamicLayer):
    """One attention layer of a `RaggedBatch`: buffers of `(row capacity, H, token capacity, D)`,
    each row's tokens from column 0 (left-aligned). `keys`/`values` view the active rows and the
    longest row's columns; `update` writes each row's one new token at that row's own column
    (`write_at`), so rows of different lengths grow in place, without copying the batch."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        self.write_at: torch.Tensor | None = None  # (B,) the column each row's next token goes to
        self.packing: Packing | None = None  # a packed step's: where each of its tokens goes

    def held(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The buffers, `(row capacity, H, token capacity, Dk)` keys and `(..., Dv)` values."""
        assert self.buffers is not None  # RaggedBatch reserves them before any row is shown
        return self.buffers

    def show(self, rows: int, width: int) -> None:
        """Point `keys`/`values` at the first `rows` rows and `width` columns of the buffers."""
        self.keys, self.values = (b[:rows, :, :width] for b in self.held())

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.packing is not None:  # (1, H, N, D)
            return self.put_packed(key_states[0].transpose(0, 1), value_states[0].transpose(0, 1))
        rows = key_states.shape[0]
        index = torch.arange(rows, device=key_states.device)
        assert self.buffers is not None  # RaggedBatch reserves them before any row decodes
        keys, values = self.buffers
        keys[index, :, self.write_at] = key_states[:, :, 0]  # (B, H, D) one token per row
        values[index, :, self.write_at] = value_states[:, :, 0]
        self.show(rows, self.keys.shape[2] + 1)
        return self.keys, self.values

    def put_packed(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A packed step's keys and values `(N, H, D)`, each token to its row's next column (by
        `packing`); returns the whole buffers (the packed attention takes each row's part)."""
        assert self.packing is not None  # set by RaggedBatch.step_packed for the step
        held_keys, held_values = self.held()
        held_keys[self.packing.row_of, :, self.packing.col_of] = keys
        held_values[self.packing.row_of, :, self.packing.col_of] = values
        return held_keys, held_values


class SlotStateLayer(LinearAttentionLayer):
    """One recurrent layer of a `RaggedBatch`: each row's state in its slot of buffers
    `(row capacity, *state shape)`, one per state (`slots`, by kind and index). The states it
    shows are views of the first rows, which the model's decode step updates in place (one
    token per row: no padding ever reaches a state)."""

    def __init__(self, **kwargs):
        super().__init__()
        self.slots: dict[tuple[str, int], torch.Tensor] = {}

    def show_state(self, rows: int, width: int) -> None:
        """Point the states at the first `rows` rows of their slots."""
        for (kind, index), buffer in self.slots.items():
            held = self.conv_states if kind == "conv" else self.recurrent_states
            held[index] = buffer[:rows]
            if kind == "conv":
                self.conv_kernel_size[index] = buffer.shape[-1]
                self.is_conv_states_initialized[index] = True
            else:
                self.is_recurrent_states_initialized[index] = True
            self.has_previous_state[index] = True
        if getattr(self, "device", None) is None and self.slots:
            first = next(iter(self.slots.values()))
            self.device, self.dtype = first.device, first.dtype
        self.cumulative_length_linear.fill_(width)  # the batch's width, as its attention layers say


class SlotHybridLayer(SlotStateLayer, SlotLayer):
    """A layer with a recurrent state beside its attention KV (Falcon-H1), in slots of both kinds."""

    def __init__(self, **kwargs):
        SlotLayer.__init__(self)
        SlotStateLayer.__init__(self)

    def get_seq_length(self) -> int:
        return DynamicLayer.get_seq_length(self)


def _states(layer) -> dict[tuple[str, int], torch.Tensor]:
    """A transformers cache layer's states by kind and index (none for an attention layer)."""
    if not isinstance(layer, LinearAttentionLayer):
        return {}
    found = {}
    for index in range(layer.number_of_states):
        if layer.is_conv_states_initialized[index]:
            found[("conv", index)] = layer.conv_states[index]
        if layer.is_recurrent_states_initialized[index]:
            found[("recurrent", index)] = layer.recurrent_states[index]
    return found


class RaggedBatch:
    """Sequences of different lengths decoded together (continuous batching). Each row holds
    its own tokens from column 0; a padding mask hides the columns past a row's length and
    each row's positions are its own, so every row computes what it would alone (in float32
    the same tokens; tested). A recurrent layer keeps each row's state in a slot of its own.

    Rows live in slots of preallocated buffers with spare rows and columns. Joining (`add`)
    copies the new row's KV and state only; leaving (`remove`) moves the last row into the hole;
    a step writes one token per row in place. Nothing copies the whole batch except growing the
    buffers (amortised). Attention works over rows x the longest row; the engine bounds that
    (its token budget). Every method runs in inference mode: the buffers are inference
    tensors, whichever call made them."""

    def __init__(self, config):
        self.config = config
        self.cache: Any = None  # a DynamicCache of slot layers, made by the first `add`
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
        return self._row_capacity, self._column_capacity

    def _new_cache(self) -> DynamicCache:
        cache = growing_cache(self.config)  # its layer kinds, by the model's layout
        kinds = {GrowingHybridLayer: SlotHybridLayer, LinearAttentionLayer: SlotStateLayer, DummyLayer: DummyLayer}
        cache.layers = [kinds.get(type(layer), SlotLayer)() for layer in cache.layers]
        return cache

    def _reserve(self, rows: int, columns: int, like: DynamicCache) -> None:
        """Make room for `rows` rows of `columns` tokens (growing by a quarter or more)."""
        have_rows, have_columns = self._capacity()
        if rows <= have_rows and columns <= have_columns:
            return
        rows = have_rows if rows <= have_rows else max(rows, 2 * have_rows, 4)
        columns = have_columns if columns <= have_columns else columns + spare_columns(columns)
        if self.cache is None:
            self.cache = self._new_cache()
        for layer, model in zip(self.cache.layers, like.layers, strict=False):
            if isinstance(layer, SlotLayer):
                self._reserve_kv(layer, model, rows, columns)
            if isinstance(layer, SlotStateLayer):
                for key, state in _states(model).items():  # (B, *shape) each
                    if key in layer.slots and layer.slots[key].shape[0] >= rows:
                        continue
                    fresh = state.new_zeros((rows, *state.shape[1:]))
                    if key in layer.slots:
                        fresh[: self.num_rows] = layer.slots[key][: self.num_rows]
                    layer.slots[key] = fresh
        self._row_capacity, self._column_capacity = rows, columns

    def _reserve_kv(self, layer: SlotLayer, model, rows: int, columns: int) -> None:
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
            if isinstance(layer, SlotLayer):
                layer.show(self.num_rows, self.width)
            if isinstance(layer, SlotStateLayer):
                layer.show_state(self.num_rows, self.width)

    @torch.inference_mode()
    def add(self, single: DynamicCache) -> int:
        """Append the batch-1 `single` as a new row (copied; `single` may be reused after).
        Returns the row's index."""
        length = num_cached(single)
        row = self.num_rows
        self._reserve(row + 1, max(self.width, length) + 1, single)
        for layer, source in zip(self.cache.layers, single.layers, strict=False):
            if isinstance(layer, SlotLayer):
                keys, values = layer.held()
                keys[row, :, :length], values[row, :, :length] = source.keys[0], source.values[0]
            if isinstance(layer, SlotStateLayer):
                for key, state in _states(source).items():
                    layer.slots[key][row] = state[0]
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
            if isinstance(layer, SlotLayer):
                for buffer in layer.held():
                    buffer[target, :, :length] = buffer[source, :, :length]
            if isinstance(layer, SlotStateLayer):
                for buffer in layer.slots.values():
                    buffer[target] = buffer[source]

    @torch.inference_mode()
    def extract(self, row: int) -> DynamicCache:
        """Row `row`'s real tokens as a batch-1 cache of its own (new memory)."""
        length = self.lengths[row]
        layout = layout_of(self.config)
        groups = []
        for group in layout.groups:
            held = [self.cache.layers[i].held() for i in group.layers]
            keys = [layer_keys[row, :, :length] for layer_keys, _ in held]  # each (H, T, Dk)
            values = [layer_values[row, :, :length] for _, layer_values in held]  # each (H, T, Dv)
            groups.append(join(keys, values))
        state = None
        if layout.has_state:
            state = {
                spec.name: self.cache.layers[spec.layer].slots[(spec.kind, spec.index)][row] for spec in layout.states
            }
        return to_cache([Entry(tuple(groups), state)], self.config)  # copied into a new cache

    @torch.inference_mode()
    def hand_back(self, row: int, cache: DynamicCache) -> DynamicCache:
        """Row `row`'s tokens past what `cache` holds, appended to `cache` in place (its spare
        room), where `cache` is the batch-1 cache the row was added from: only the tokens the
        batch computed are copied, not the whole row (`extract`). A layout with recurrent
        state is extracted whole (its state lives in the batch's slots). Returns `cache`."""
        if layout_of(self.config).has_state:
            return self.extract(row)
        have, length = num_cached(cache), self.lengths[row]
        for index, layer in enumerate(self.cache.layers):
            if isinstance(layer, SlotLayer):
                keys, values = layer.held()
                cache.layers[index].update(keys[row : row + 1, :, have:length], values[row : row + 1, :, have:length])
        return cache

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

    @torch.inference_mode()
    def step_packed(self, model, feeds: Sequence[Sequence[int]]) -> torch.Tensor:
        """Feed each row its ids (one to decode, a prompt's chunk to prefill) in one packed
        forward (ragkv.kv.packed; only where `packable(model)`); returns each row's next-token
        logits after its last id `(B, V)`. Grows every row by what it was fed."""
        device = model.device
        fed = [len(ids) for ids in feeds]
        self._reserve(self.num_rows, max(n + f for n, f in zip(self.lengths, fed, strict=True)), self.cache)
        self._show()
        packing = Packing.of(self.lengths, fed, device)
        for layer in self.cache.layers:
            layer.packing = packing
        ids = torch.tensor([[token for row in feeds for token in row]], dtype=torch.long, device=device)  # (1, N)
        try:
            if direct.serves(model):  # the same operations without transformers' wrapping (bitwise equal)
                logits = direct.forward(model, ids, packing, self.cache.layers)
            else:
                with attending_packed(model):
                    logits = model(
                        input_ids=ids,
                        attention_mask=packing.mask[:1],  # 4D: taken as it is; packed_attention reads the packing
                        position_ids=packing.positions,
                        cache=self.cache,
                        use_cache=True,
                        logits_to_keep=packing.last,
                        ragkv_packing=packing,
                    ).logits[0]
        finally:
            for layer in self.cache.layers:
                layer.packing = None
        self.lengths = [n + f for n, f in zip(self.lengths, fed, strict=True)]
        self._show()
        return logits


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
    layer_types = getattr(config.get_text_config(), "layer_types", None)
    if layer_types is None:
        return sliding  # every layer slides (Mistral): the model takes one mask
    masks = dict.fromkeys(layer_types)  # a recurrent layer takes none in a one-token step
    masks.update({"full_attention": create_causal_mask(**shape), "sliding_attention": sliding})
    return masks
