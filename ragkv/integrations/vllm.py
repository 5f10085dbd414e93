"""ragkv's store as vLLM's memory: a KV connector through which vLLM prefills only what the
store does not hold, stores what it computes that the store lacks, and logs what is asked.

    --kv-transfer-config '{"kv_connector": "RagkvConnector",
                           "kv_connector_module_path": "ragkv.integrations.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"store": "./kvstore"}}'

`kv_role` "kv_both" loads and saves; "kv_consumer" only loads (a read-only store).

Scheduler side: a new request's prompt ids are matched against the store's system prefix and
chunk entries (ragkv.integrations.store_match); the matched tokens, cut to whole blocks and
leaving the last prompt token to compute, are reported as external hits beyond what vLLM's
own prefix cache holds. A request laid out by ragkv's front names its chunks in
`kv_transfer_params` (see store_match): each chunk's use is logged in the store's hit log,
and the chunks the store lacks at the head of the prompt, laid out as ingest computes them (a
chunk alone, or a span from its start: every missing chunk of it), are each marked to save
once the step that computes its last token is scheduled.

Worker side, loading: before the forward, the matched KV is read from the shards (checksums
verified) and written into the request's blocks through the attention backend's own
cache-update op (the write vLLM's forward makes, so any paged layout is respected). On CUDA
the copies go layer by layer on a side stream from page-locked memory, and each attention
layer waits only for its own layer (`wait_for_layer_load`), so loading overlaps the forward
(the first such forward also waits for the whole load, and shows whether the backend waits per
layer: one that does not gets loads before the forward from then on); on a CPU they are made
before the forward.

Worker side, saving: after the forward (`wait_for_save`), each chunk's token range is gathered
out of every layer's blocks (the backend's layout is probed once, ragkv.integrations.paged)
into one copy, so vLLM may reuse the blocks at once and decoding never waits on the store;
on CUDA the copy to host is asynchronous. A thread encodes it and hands it to the store's
write-back (ragkv.store.kv.writeback): one writer, batched generations, the budget's admission by
popularity, a bounded wait behind another writer, and a failed write logged once while
answering goes on. A kill at any point leaves the published store as it was.

On an S3 store (`"store": "s3://bucket/prefix"`, credentials from the usual AWS settings), or on
a folder with `"leave_pending": true`, vLLM is a replica that never takes the store's lock:
the KV it computes and the uses it logs are left as objects under the store's `pending/`
(at most `"pending_bytes"` of KV, oldest dropped first) for the store's one writer to fold
(`ragkv fold`, `ragkv serve --writer`, the nightly `reindex`); shards are read from the
machine's mirror of the bucket, fetched when first needed. Such a replica also loads what
the others left pending (the scheduler matches a laid-out request's missing chunks against
`pending/`, ragkv.store.kv.pending.PendingIndex) instead of computing it again. `"writer": true` makes
it the one writer instead (what `ingest --engine vllm` runs).

Models beyond full attention: the connector supports vLLM's hybrid allocator (`SupportsHMA`), and
each layer moves through its own KV cache group's blocks (ragkv.integrations.vllm_load): a
sliding layer the window before the end; a Mamba2 layer's stored state goes into the request's
state block, and such a model's chunks are loaded, never saved (the state at a chunk's end is
gone by the end of the step). For both, a load stops at an entry's end.

A request opts out with `extra_args={"kv_transfer_params": {"ragkv": "skip"}}` (a full prefill:
for comparisons). At start, a store without KV for the served model, tokenizer and dtype is
refused with one line, as is a quantised vLLM KV cache. Import this module only inside vLLM.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ragkv.core.errors import InputError, ModelError, StoreCorruptError
from ragkv.integrations.paged import LayoutError
from ragkv.integrations.store_match import (
    ModelIdentity,
    RequestLayout,
    RequestPlan,
    StoreMatch,
    StoreMatcher,
    chunk_layout,
    profile_for,
)
from ragkv.integrations.transfer import TIMINGS_KEPT, KVSaver, load_kv
from ragkv.integrations.vllm_load import PagedLoader, layer_groups
from ragkv.integrations.vllm_plan import LoadSpec, PendingSave, RagkvConnectorMetadata, plan_step
from ragkv.kv.entry import Entry
from ragkv.kv.layout import KVLayout
from ragkv.kv.movable import refuse_unless_movable
from ragkv.loading.uses import UseLog
from ragkv.store.kv.pending import PendingArea, PendingIndex
from ragkv.store.kv.pending_hits import PendingHits
from ragkv.store.kv.popularity import HitLog
from ragkv.store.kv.writeback import PENDING_BYTES, leaves_pending
from ragkv.store.snapshot import shard_reader

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("ragkv")
ENGINE = "vllm"  # recorded in the header of the shards this connector writes


class RagkvConnector(KVConnectorBase_V1, SupportsHMA):
    _cache_hit_source = CacheHitSource.DISK

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        store = self._kv_transfer_config.get_from_extra_config("store", None)
        if not store:
            raise ValueError('RagkvConnector needs kv_connector_extra_config {"store": "PATH"}')
        identity = self._check(vllm_config)
        self._profile = profile_for(store, identity)  # refuses another model, tokenizer or dtype, in one line
        layout = KVLayout.from_string(self._profile.kv_layout) if self._profile.kv_layout else identity.layout
        self._layout = layout
        # A sliding layer's stored window, and a recurrent state, end where an entry ends: a load
        # stops at an entry's end. A state at a chunk's end is gone by the end of the step that
        # computes the prompt, so a recurrent model's chunks are loaded, never saved.
        self._stateful = layout is not None and layout.has_state
        self._at_entries = layout is not None and (any(layout.windows) or layout.has_state)
        self._block_size = vllm_config.cache_config.block_size
        self._store = str(store)
        self._saves_on = self._kv_transfer_config.kv_role in ("kv_both", "kv_producer") and not self._stateful
        # vLLM's own prefix caching of a recurrent state ("align") keeps it per block: not where a load writes
        self._loads_state = getattr(vllm_config.cache_config, "mamba_cache_mode", "none") == "none"
        extra = self._kv_transfer_config.get_from_extra_config
        leave, writer = bool(extra("leave_pending", False)), bool(extra("writer", False))  # writer: an ingest's
        self._write_options = {
            "pending_bytes": int(extra("pending_bytes", PENDING_BYTES)),
            "leave_pending": leave,
            "writer": writer,
        }
        self._leaves_pending = leaves_pending(store, leave, writer)
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler(store, identity)
        else:
            self._init_worker(store)
        log.info(
            "ragkv connector: store %s, profile %s, block size %d, %s",
            store,
            self._profile.profile_id[:12],
            self._block_size,
            "loads and saves" if self._saves_on else "loads only",
        )

    def _check(self, vllm_config: VllmConfig) -> ModelIdentity:
        """Refuse, in one line and before anything moves, a KV this connector cannot store
        exactly; the served model's identity."""
        cache_dtype = getattr(vllm_config.cache_config, "cache_dtype", "auto")
        if cache_dtype not in ("auto", None):
            raise ModelError(
                f"ragkv stores KV in the model's dtype; vLLM's --kv-cache-dtype {cache_dtype} would "
                "load and save another KV: serve with the default"
            )
        model_config = vllm_config.model_config
        refuse_unless_movable(model_config.model)
        self._dtype = model_config.dtype
        return ModelIdentity.of_folder(model_config.model, str(self._dtype).removeprefix("torch."))

    def _init_scheduler(self, store: str, identity: ModelIdentity) -> None:
        from ragkv.model.prompt import PromptLayout

        layout = PromptLayout.build(identity.tokenizer, "")
        self._separator_len = len(layout.separator_ids)
        fleet = PendingIndex(PendingArea(store)) if self._leaves_pending else None
        self._matcher = StoreMatcher(store, self._profile, layout.separator_ids, identity.tokenizer, fleet)
        self._matched: dict[str, tuple[StoreMatch, int, int]] = {}  # request -> match, start, end
        self._to_load: dict[str, tuple[StoreMatch, int, int]] = {}
        self._plans: dict[str, RequestPlan] = {}  # matched, not yet allocated
        self._pending_saves: dict[str, PendingSave] = {}
        self._logged: set[str] = set()  # requests whose uses are logged
        log_uses = self._kv_transfer_config.get_from_extra_config("log_uses", True)
        # an ingest's are not uses; a replica that does not write the store leaves them pending for a fold
        self._uses: UseLog | None = None
        if log_uses:
            hit_log = PendingHits(store) if self._leaves_pending else HitLog(Path(store))
            self._uses = UseLog(hit_log, store, "the ragkv connector")
        self._warned_params = False

    def _init_worker(self, store: str) -> None:
        self._shards = shard_reader(store)
        self._pending_area = PendingArea(store) if self._leaves_pending else None
        self._load_errors: set[int] = set()  # blocks whose load failed this step: vLLM recomputes them
        layerwise = self._kv_transfer_config.get_from_extra_config("layerwise", "auto")
        groups = layer_groups(self._kv_cache_config)  # a sliding layer's group keeps only its window
        loader_mode = layerwise if isinstance(layerwise, bool) else None  # None: layer by layer on CUDA only
        self._loader = PagedLoader(loader_mode, groups, self._block_size, self._layout)
        self.load_ms: deque[tuple[float, float]] = deque(maxlen=TIMINGS_KEPT)  # per load: (shard read, copies) ms
        self._saver: KVSaver | None = None
        self._saving_broken = False
        self._wait_saves = bool(self._kv_transfer_config.get_from_extra_config("wait_saves", False))  # ingest

    # -- scheduler side -------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if isinstance(params, dict) and params.get("ragkv") == "skip":
            return 0, False
        prompt = list(request.prompt_token_ids or [])
        match = self._matcher.match(prompt)
        if match is None or (self._stateful and not self._loads_state):
            return 0, False
        plan = self._plan(request, prompt, match)
        self._plans[request.request_id] = plan
        match = plan.match or match  # with what other replicas left pending (on S3)
        end = self._load_end(match, len(prompt))
        if end <= num_computed_tokens:
            return 0, False
        self._matched[request.request_id] = (match, num_computed_tokens, end)
        return end - num_computed_tokens, False

    def _load_end(self, match: StoreMatch, num_prompt: int) -> int:
        """Where a load of `match` stops, never at the last prompt token (vLLM computes it for the
        logits): whole blocks; for a model with sliding or recurrent layers, the end of an entry
        instead, since the store keeps of a sliding layer only an entry's last `window - 1`
        tokens, all the next token reads from there (a load cut inside an entry would lack the
        start of the window), and a state only after an entry's last token."""
        limit = min(match.num_tokens, num_prompt - 1)
        if not self._at_entries:
            return limit // self._block_size * self._block_size
        end = 0
        for entry in match.entries:
            if end + entry.num_tokens > limit:
                break
            end += entry.num_tokens
        return end

    def _plan(self, request: Request, prompt: list[int], match) -> RequestPlan:
        """The request's uses and save, from the layout its params name (none without)."""
        try:
            layout = chunk_layout(
                request.kv_transfer_params, len(prompt), len(self._profile.prefix_ids), self._separator_len
            )
        except InputError as exc:  # a client's own params: never the engine's failure
            if not self._warned_params:
                self._warned_params = True
                log.warning("ragkv connector: %s; the request is served without them (logged once)", exc)
            layout = RequestLayout()
        return self._matcher.plan(prompt, layout.chunks, layout.write_back and self._saves_on, match)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        request_id = request.request_id
        matched = self._matched.pop(request_id, None)
        if num_external_tokens > 0 and matched is not None:
            self._to_load[request_id] = matched
        plan = self._plans.pop(request_id, None)
        if plan is None or request_id in self._logged:
            return
        self._logged.add(request_id)
        self._record(plan)
        if plan.saves:
            self._pending_saves[request_id] = PendingSave(list(plan.saves))

    def _record(self, plan: RequestPlan) -> None:
        if self._uses is not None and plan.uses:
            self._uses.write(list(plan.uses))  # a read-only store still serves; it only stops counting

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return plan_step(scheduler_output, self._to_load, self._pending_saves)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        request_id = request.request_id
        self._matched.pop(request_id, None)
        self._plans.pop(request_id, None)
        self._pending_saves.pop(request_id, None)
        self._logged.discard(request_id)
        return False, None  # a save copies its tokens out in the step that computes them: free the blocks

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """The hybrid allocator's `request_finished`: the blocks of every group, freed at once."""
        return self.request_finished(request, list(block_ids[0]) if block_ids else [])

    # -- worker side ----------------------------------------------------------------------
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._loader.find_layers(forward_context)
        meta = self._get_connector_metadata()
        if not isinstance(meta, RagkvConnectorMetadata) or not meta.loads:
            return
        for load in meta.loads:
            started = time.perf_counter()
            try:
                entry = self._read(load)
            except (OSError, StoreCorruptError) as exc:
                self._load_errors.update(self._loader.blocks_written(load.start, load.end, load.block_ids))
                log.warning("ragkv connector: cannot read request %s's stored KV (%s)", load.request_id, exc)
                continue
            read = time.perf_counter()
            kv_tensor = entry.kv[:, :, :, load.start : load.end]  # (L, 2, H, T, D)
            self._loader.load(kv_tensor, load.start, load.end, load.block_ids, forward_context)
            if entry.state is not None:  # the entries end at load.end: their state is the one after it
                self._loader.load_state(entry.state, load.block_ids, forward_context)
            self.load_ms.append(((read - started) * 1000.0, (time.perf_counter() - read) * 1000.0))

    def _read(self, load: LoadSpec) -> Entry:
        """The load's entries joined (`load_kv`, pending ones included): those up to the load's end
        for a model with recurrent layers, whose state is then the one after it."""
        area = (self._pending_area or PendingArea(self._store)) if load.pending else None
        entries, end = list(load.entries), 0
        if self._stateful:
            for count, row in enumerate(load.entries):
                end += row.num_tokens
                if end == load.end:
                    entries = entries[: count + 1]
                    break
        return load_kv(self._shards, entries, self._dtype, load.pending, area, self._store)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._load_errors = self._load_errors, set()
        return failed

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._loader.wait_for_layer(layer_name)

    @property
    def layer_waits(self) -> int:
        """wait_for_layer_load calls that waited on a layer's copy (tests)."""
        return self._loader.layer_waits

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # saves are gathered once per step, over all layers, in wait_for_save

    def wait_for_save(self) -> None:
        self._loader.end_step()
        meta = self._get_connector_metadata()
        if not isinstance(meta, RagkvConnectorMetadata) or not meta.saves or self._saving_broken:
            return
        if self._saver is None:
            self._saver = KVSaver(
                self._store,
                self._profile,
                Path(self._vllm_config.model_config.model).name,
                ENGINE,
                wait=self._wait_saves,
                layout=self._layout,
                **self._write_options,
            )
        for spec in meta.saves:
            started = time.perf_counter()
            try:
                gathered = self._loader.gather(spec.block_ids, spec.target, self._kv_cache_config.num_blocks)
            except LayoutError as exc:
                self._saving_broken = True
                log.warning(
                    "ragkv connector: cannot read KV out of this attention backend (%s); loading goes on, "
                    "saving is off",
                    exc,
                )
                return
            self._saver.submit(spec.target, *gathered, copy_ms=(time.perf_counter() - started) * 1000.0)

    def flush(self) -> None:
        """Worker side: wait until every save handed over so far is written (or given up)."""
        saver = getattr(self, "_saver", None)
        if saver is not None:
            saver.flush()

    def shutdown(self) -> None:
        saver = getattr(self, "_saver", None)
        if saver is not None:
            saver.close()
        uses = getattr(self, "_uses", None)
        if uses is not None:  # the uses still buffered (S3): left for the fold
            uses.close()
        super().shutdown()
