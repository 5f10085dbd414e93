"""Stored KV written into a paged attention cache: the worker side of ragkv's vLLM connector
(ragkv.integrations.vllm). Each layer's tokens go into the request's blocks of the layer's KV
cache group through the attention backend's own cache-update op (the write vLLM's forward makes,
so any paged layout is respected): all before the forward, or, on CUDA, layer by layer on a side
stream from page-locked memory, each attention layer waiting only for its own copy. A layer in a
sliding-window group (vLLM's hybrid allocator keeps only the window's blocks) takes, and gives
back when saved, only the window before the end: what the next token reads, and what the store
keeps of it."""

from __future__ import annotations

import logging
import re
from typing import Any

import torch

from ragkv.integrations.paged import PagedLayout, block_dim_of
from ragkv.integrations.transfer import slot_mapping
from ragkv.integrations.vllm_plan import Blocks
from ragkv.kv.layout import KVLayout

log = logging.getLogger("ragkv")
_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def layer_groups(kv_cache_config) -> dict[str, tuple[int, int | None]]:
    """Each attention layer's KV cache group and its sliding window (None: every token kept),
    by layer name, from vLLM's `KVCacheConfig`."""
    found = {}
    for index, group in enumerate(getattr(kv_cache_config, "kv_cache_groups", None) or []):
        window = getattr(group.kv_cache_spec, "sliding_window", None)
        for name in group.layer_names:
            found[name] = (index, window)
    return found


class PagedLoader:
    """Loads into the attention layers of one worker. `layerwise`: True or False, or None for
    layer by layer on CUDA only. The first layer-by-layer step also waits for the whole load
    and shows whether the backend waits per layer; one that does not gets loads before the
    forward from then on. `groups`: each layer's KV cache group and window (`layer_groups`).
    `layout`: the store's (which model layers its KV rows are, and their recurrent states)."""

    def __init__(
        self,
        layerwise: bool | None,
        groups: dict[str, tuple[int, int | None]],
        block_size: int,
        layout: KVLayout | None = None,
    ):
        self.layers: dict[int, tuple[str, Any]] = {}  # layer index -> (name, attention layer)
        self.state_layers: dict[int, tuple[str, Any]] = {}  # layer index -> (name, Mamba layer)
        self.groups = groups
        self.block_size = block_size
        self.layout = layout
        self.layerwise = layerwise
        self.layer_waits = 0  # wait_for_layer calls that waited on a layer's copy (tests)
        self._events: dict[str, Any] = {}
        self._checked = False  # has a forward been seen to wait for every layer?
        self._this_step = False
        self._inflight: list[torch.Tensor] = []  # host buffers the side stream still reads
        self._stream: torch.cuda.Stream | None = None
        self._paged: PagedLayout | None = None  # the block layout, probed on the first gather

    def find_layers(self, forward_context) -> None:
        """The attention layers holding a KV cache, and the Mamba layers holding a state, by
        index (once)."""
        if self.layers:
            return
        for name, layer in forward_context.no_compile_layers.items():
            found = _LAYER_INDEX.search(name)
            cache = getattr(layer, "kv_cache", None)
            if not found or cache is None:
                continue
            if hasattr(layer, "impl"):
                self.layers[int(found.group(1))] = (name, layer)
            elif isinstance(cache, (tuple, list)) and type(layer).__name__.startswith("Mamba"):
                self.state_layers[int(found.group(1))] = (name, layer)

    def kv_layers(self) -> list[tuple[str, Any]]:
        """The attention layers in the order of a stored entry's KV rows (the layout's layers)."""
        indices = self.layout.groups[0].layers if self.layout is not None and self.layout.groups else None
        if indices is None or set(indices) != set(self.layers):
            indices = tuple(sorted(self.layers))
        return [self.layers[index] for index in indices]

    def state_layers_of(self, layout: KVLayout) -> dict[int, tuple[str, Any]]:
        """vLLM's Mamba layers by the model layer whose state each keeps, matched in order (vLLM
        numbers some apart from their layer: Falcon-H1's is `model.{layers + i}.mixer`)."""
        wanted = sorted({spec.layer for spec in layout.states})
        found = [self.state_layers[index] for index in sorted(self.state_layers)]
        if len(found) != len(wanted):
            raise RuntimeError(f"the store keeps the state of {len(wanted)} layers, vLLM has {len(found)} Mamba layers")
        return dict(zip(wanted, found, strict=True))

    def load_state(self, state, block_ids: Blocks, forward_context) -> None:
        """A stored entry's recurrent `state` (`ragkv.kv.layout.StateSpec.name` -> tensor, as
        transformers keeps it) into each Mamba layer's state block of the request: the conv
        window's last `kernel - 1` inputs, oriented as vLLM keeps them, and the state matrix."""
        assert self.layout is not None  # a state comes only with the store's layout
        by_layer = self.state_layers_of(self.layout)
        for spec in self.layout.states:
            name, layer = by_layer[spec.layer]
            block = block_ids[self.groups.get(name, (0, None))[0]][0]  # the request's one state block
            target = layer.kv_cache[0 if spec.kind == "conv" else 1][block]  # a Mamba layer's: (conv, ssm)
            value = state[spec.name].to(target.device, target.dtype)
            if spec.kind == "conv":  # transformers: (dim, kernel); vLLM: the last kernel - 1, (dim, k-1) or (k-1, dim)
                dim_first = target.shape[0] == value.shape[0]
                width = target.shape[1] if dim_first else target.shape[0]
                value = value[:, -width:] if dim_first else value[:, -width:].T
            if target.shape != value.shape:
                raise RuntimeError(
                    f"vLLM keeps layer {spec.layer}'s {spec.kind} state as {tuple(target.shape)}, "
                    f"the store as {tuple(value.shape)}"
                )
            target.copy_(value)

    @staticmethod
    def cache(layer, forward_context) -> torch.Tensor:
        cache = layer.kv_cache
        if isinstance(cache, (list, tuple)):  # older vLLM: one cache per virtual engine
            cache = cache[getattr(forward_context, "virtual_engine", 0)]
        return cache

    def first_token(self, name: str, start: int, end: int) -> int:
        """The first of tokens start..end-1 that layer `name` keeps: a sliding group's blocks
        hold only the window before `end` (vLLM's null block stands for the ones before)."""
        _, window = self.groups.get(name, (0, None))
        return max(start, end - window + 1) if window else start

    def placements(self, start: int, end: int, block_ids: Blocks) -> dict[int, tuple[int, torch.Tensor]]:
        """Per row of the stored KV (`kv_layers`): the first token its layer takes of start..end-1
        and those tokens' cache slots in its group's blocks, `(T_layer,)`."""
        placed = {}
        for row, (name, _) in enumerate(self.kv_layers()):
            first = self.first_token(name, start, end)
            group = self.groups.get(name, (0, None))[0]
            placed[row] = (first, slot_mapping(block_ids[group], self.block_size, first, end))
        return placed

    def blocks_written(self, start: int, end: int, block_ids: Blocks) -> set[int]:
        """The blocks a load of tokens start..end-1 writes, in every group (what vLLM recomputes
        when the load fails)."""
        written: set[int] = set()
        for name, (group, _) in self.groups.items():
            first = self.first_token(name, start, end)
            written.update(block_ids[group][first // self.block_size : -(-end // self.block_size)])
        return written or set(block_ids[0][start // self.block_size : -(-end // self.block_size)])

    def load(self, kv_tensor: torch.Tensor, start: int, end: int, block_ids: Blocks, forward_context) -> None:
        """`kv_tensor` `(L, 2, H, T, D)`, tokens start..end-1, into every layer's blocks."""
        if kv_tensor.shape[0] != len(self.layers):
            raise RuntimeError(f"ragkv store KV has {kv_tensor.shape[0]} layers, the model {len(self.layers)}")
        device = self.cache(self.kv_layers()[0][1], forward_context).device
        layerwise = self.layerwise if self.layerwise is not None else device.type == "cuda"
        placed = self.placements(start, end, block_ids)
        if layerwise:
            self._load_layerwise(kv_tensor, start, placed, forward_context, device.type == "cuda")
        else:
            self._load_now(kv_tensor, start, placed, forward_context)

    def _load_now(self, kv_tensor: torch.Tensor, start: int, placed: dict, forward_context) -> None:
        """Every layer's KV written into its blocks, before the forward."""
        for index, (_, layer) in enumerate(self.kv_layers()):
            cache = self.cache(layer, forward_context)
            first, slots = placed[index]
            key = kv_tensor[index, 0, :, first - start :].transpose(0, 1).contiguous().to(cache.device)  # (T, H, D)
            value = kv_tensor[index, 1, :, first - start :].transpose(0, 1).contiguous().to(cache.device)
            layer.impl.do_kv_cache_update(layer, key, value, cache, slots.to(cache.device))

    def _load_layerwise(self, kv_tensor: torch.Tensor, start: int, placed: dict, forward_context, cuda: bool) -> None:
        """Each layer's copy started on a side stream (CUDA: from page-locked memory, so it is
        asynchronous), with an event per layer that `wait_for_layer` makes the forward wait
        on; on a CPU the same steps run in order (a test of the bookkeeping)."""
        host = kv_tensor.permute(0, 1, 3, 2, 4).contiguous()  # (L, 2, T, H, D): one contiguous copy per layer
        if cuda:
            host = host.pin_memory()
            if self._stream is None:
                self._stream = torch.cuda.Stream()
            self._stream.wait_stream(torch.cuda.current_stream())  # after vLLM zeroes new blocks
            self._inflight.append(host)
        for index, (name, layer) in enumerate(self.kv_layers()):
            cache = self.cache(layer, forward_context)
            first, slots = placed[index]
            key, value = host[index, 0, first - start :], host[index, 1, first - start :]  # (T_layer, H, D) each
            if cuda:
                with torch.cuda.stream(self._stream):
                    key, value = key.to(cache.device, non_blocking=True), value.to(cache.device, non_blocking=True)
                    layer.impl.do_kv_cache_update(layer, key, value, cache, slots.to(cache.device, non_blocking=True))
                    copied = torch.cuda.Event()
                    copied.record(self._stream)
                    event: torch.cuda.Event | bool = copied
            else:
                layer.impl.do_kv_cache_update(layer, key, value, cache, slots)
                event = True
            self._events[name] = event
        self._this_step = True
        if cuda and not self._checked:
            # Until a forward is seen to wait per layer, it also waits for the whole load: safe
            # even where an attention backend never calls wait_for_layer_load.
            torch.cuda.current_stream().wait_event(copied)  # the last layer's copy

    def wait_for_layer(self, layer_name: str) -> None:
        """The forward's attention `layer_name` waits for its layer's copy, if one is under way."""
        event = self._events.pop(layer_name, None)
        if event is None:
            return
        self.layer_waits += 1
        if event is not True:
            torch.cuda.current_stream().wait_event(event)

    def end_step(self) -> None:
        """After the forward: whether it waited for every layer is known (once), and the side
        stream's buffers are free."""
        if self._this_step:
            self._this_step = False
            if self._events and not self._checked:  # some layer's attention never waited
                log.warning(
                    "ragkv connector: this attention backend does not wait for each layer's load; loads are "
                    "made before the forward from now on"
                )
                self.layerwise = False
            self._checked = True
            self._events.clear()
        if self._inflight and self._stream is not None:
            self._stream.synchronize()  # the forward waited on every layer's copy: done already
        self._inflight.clear()

    def gather(self, block_ids: Blocks, target, num_blocks: int) -> tuple[torch.Tensor, Any]:
        """The KV `(L, 2, H, T, D)` of `target`'s tokens (its start..end) copied out of every
        layer's blocks of its group in `block_ids` (a sliding group's: the window before the end,
        zeros before it; on CUDA, into page-locked host memory, asynchronously: with the event
        that says it is there). Raises LayoutError for a backend whose block layout the probe
        cannot read."""
        named = self.kv_layers()
        layers = [layer for _, layer in named]
        caches = [PagedLoader.cache(layer, None) for layer in layers]
        if self._paged is None:
            first, cache = layers[0], caches[0]
            self._paged = PagedLayout.probe(
                lambda k, v, c, s: first.impl.do_kv_cache_update(first, k, v, c, s),
                cache,
                block_dim_of(cache, num_blocks),
                self.block_size,
                first.num_kv_heads,
                first.head_size,
            )
        parts = [self._gather_layer(name, c, block_ids, target) for (name, _), c in zip(named, caches, strict=True)]
        kv_tensor = torch.stack(parts)  # (L, 2, H, T, D)
        if kv_tensor.device.type != "cuda":
            return kv_tensor, None
        host = torch.empty(kv_tensor.shape, dtype=kv_tensor.dtype, pin_memory=True)
        host.copy_(kv_tensor, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event

    def _gather_layer(self, name: str, cache: torch.Tensor, block_ids: Blocks, target) -> torch.Tensor:
        """One layer's `(2, H, T, D)` of `target`'s tokens from its group's blocks (zeros before
        a sliding group's window)."""
        assert self._paged is not None  # gather probes it first
        group = self.groups.get(name, (0, None))[0]
        first = self.first_token(name, target.start, target.end)
        held = self._paged.gather(cache, block_ids[group], first, target.end)  # (2, H, T_layer, D)
        if first == target.start:
            return held
        out = held.new_zeros((*held.shape[:2], target.end - target.start, held.shape[3]))
        out[:, :, first - target.start :] = held
        return out
