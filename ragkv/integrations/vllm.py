"""ragkv's store as a vLLM KV connector: vLLM prefills only what the store does not hold.

    --kv-transfer-config '{"kv_connector": "RagkvConnector",
                           "kv_connector_module_path": "ragkv.integrations.vllm",
                           "kv_role": "kv_consumer",
                           "kv_connector_extra_config": {"store": "./kvstore"}}'

Scheduler side: a new request's prompt ids are matched against the store's system prefix and
chunk entries (ragkv.integrations.store_match); the matched tokens, cut to whole blocks and
leaving the last prompt token to compute, are reported as external hits beyond what vLLM's
own prefix cache holds. Worker side: before the forward, the matched KV is read from the
shards (checksums verified), and written into the request's blocks, layer by layer, through
the attention backend's own cache-update op (the same write vLLM's forward makes, so any
paged layout the backend uses is respected).

A request opts out with `extra_args={"kv_transfer_params": {"ragkv": "skip"}}` (a full prefill:
for comparisons). At start, a store without KV for the served model, tokenizer and dtype is
refused with one line. Import this module only inside vLLM (it imports vllm).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ragkv.integrations.store_match import ModelIdentity, StoreMatcher, load_kv, profile_for, slot_mapping
from store import EntryRow
from store.shards import ShardReader

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("ragkv")
_LAYER_INDEX = re.compile(r"\.(\d+)\.")


@dataclass(frozen=True)
class LoadSpec:
    """One request's load: the entries covering prompt tokens 0..end, of which start..end
    (those vLLM's own cache lacks) go into `block_ids`."""

    request_id: str
    entries: tuple[EntryRow, ...]
    start: int
    end: int
    block_ids: tuple[int, ...]


@dataclass
class RagkvConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class RagkvConnector(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.DISK

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        store = self._kv_transfer_config.get_from_extra_config("store", None)
        if not store:
            raise ValueError('RagkvConnector needs kv_connector_extra_config {"store": "PATH"}')
        model_config = vllm_config.model_config
        self._dtype = model_config.dtype
        identity = ModelIdentity.of_folder(model_config.model, _dtype_name(self._dtype))
        profile = profile_for(store, identity)  # refuses another model, tokenizer or dtype, in one line
        self._block_size = vllm_config.cache_config.block_size
        self._store = str(store)
        if role == KVConnectorRole.SCHEDULER:
            from ragkv.prompt import PromptLayout

            separator = PromptLayout.build(identity.tokenizer, "").separator_ids
            self._matcher = StoreMatcher(store, profile, separator)
            self._matched: dict[str, tuple[tuple[EntryRow, ...], int, int]] = {}  # request -> entries, start, end
            self._to_load: dict[str, tuple[tuple[EntryRow, ...], int, int]] = {}
        else:
            from store.store import SHARD_DIR
            from pathlib import Path

            self._shards = ShardReader(Path(store) / SHARD_DIR)
        log.info("ragkv connector: store %s, profile %s, block size %d", store, profile.profile_id[:12],
                 self._block_size)

    # -- scheduler side -------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params or {}
        if params.get("ragkv") == "skip":
            return 0, False
        prompt = list(request.prompt_token_ids or [])
        match = self._matcher.match(prompt)
        if match is None:
            return 0, False
        # Whole blocks only, and never the last prompt token: vLLM computes it for the logits.
        end = min(match.num_tokens, len(prompt) - 1) // self._block_size * self._block_size
        if end <= num_computed_tokens:
            return 0, False
        self._matched[request.request_id] = (match.entries, num_computed_tokens, end)
        return end - num_computed_tokens, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        matched = self._matched.pop(request.request_id, None)
        if num_external_tokens > 0 and matched is not None:
            self._to_load[request.request_id] = matched

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = RagkvConnectorMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id in self._to_load:
                entries, start, end = self._to_load.pop(new.req_id)
                meta.loads.append(LoadSpec(new.req_id, entries, start, end, tuple(new.block_ids[0])))
        self._to_load.clear()  # not scheduled after all (preempted): vLLM computes them
        return meta

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._matched.pop(request.request_id, None)
        return False, None

    # -- worker side ----------------------------------------------------------------------
    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, RagkvConnectorMetadata) or not meta.loads:
            return
        layers = {}
        for name, layer in forward_context.no_compile_layers.items():
            found = _LAYER_INDEX.search(name)
            if found and getattr(layer, "kv_cache", None) is not None and hasattr(layer, "impl"):
                layers[int(found.group(1))] = layer
        for load in meta.loads:
            kv_tensor = load_kv(self._shards, load.entries, self._dtype)[:, :, :, load.start:load.end]  # (L, 2, H, T, D)
            if kv_tensor.shape[0] != len(layers):
                raise RuntimeError(f"ragkv store KV has {kv_tensor.shape[0]} layers, the model {len(layers)}")
            slots = slot_mapping(load.block_ids, self._block_size, load.start, load.end)
            for index, layer in sorted(layers.items()):
                cache = layer.kv_cache
                if isinstance(cache, (list, tuple)):  # older vLLM: one cache per virtual engine
                    cache = cache[getattr(forward_context, "virtual_engine", 0)]
                slots_here = slots.to(cache.device)
                key = kv_tensor[index, 0].transpose(0, 1).contiguous().to(cache.device)  # (T, H, D)
                value = kv_tensor[index, 1].transpose(0, 1).contiguous().to(cache.device)  # (T, H, D)
                layer.impl.do_kv_cache_update(layer, key, value, cache, slots_here)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv writes every layer before the forward starts

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # a consumer: ragkv ingest writes the store

    def wait_for_save(self) -> None:
        return
