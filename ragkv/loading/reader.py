"""Stored KV read and verified: a chunk's entry from the RAM tier, else from its shard into a
reused read buffer (or straight into the cache being built), kept hot after; and the
system-prompt KV, read once."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ragkv.core.errors import StoreCorruptError
from ragkv.core.keys import KVKey
from ragkv.core.lru import ByteLRU
from ragkv.kv import cache as kv
from ragkv.kv import codec
from ragkv.kv.entry import Entry
from ragkv.model.llm import LoadedModel
from ragkv.model.profiles import ActiveProfile
from ragkv.modes.assemble import Assembly
from ragkv.store import StoreSnapshot


@dataclass
class Loaded:
    """What `KVLoader.load` assembled for a prompt, and how."""

    assembly: Assembly
    kv_quant: str = "none"  # how the reused KV was stored
    fallback: bool = False  # the mode could not be used: the prompt is prefilled in full
    kv_sources: dict[int, str] = field(default_factory=dict)  # chunk id -> "store", "ram" or "computed"
    ram_hits: int = 0
    ram_misses: int = 0
    kv_read_ms: float = 0.0
    assemble_ms: float = 0.0
    kv_compute_ms: float = 0.0
    warnings: list[str] = field(default_factory=list)


class StoredReads:
    """One profile's stored KV read from one open generation (`switch` moves it), verified, and
    kept hot in a RAM tier bounded by bytes."""

    def __init__(self, snapshot: StoreSnapshot, lm: LoadedModel, active: ActiveProfile, device: str, ram_bytes: int):
        self.snapshot = snapshot
        self.lm = lm
        self.active = active
        self.device = device
        self.ram: ByteLRU[Entry] = ByteLRU(ram_bytes)  # hot chunk entries by key, verified when loaded
        # With tenants isolated (KVLoader.tenant), the tenant whose request is loading: its RAM
        # tier entries are its own, so no tenant can time what another read.
        self.salt = ""
        self._prefix_kv: Entry | None = None  # pinned in memory after the first load
        self._read_buffers: list[torch.Tensor] = []  # stored KV is read into these (reused memory)

    def chunk(self, entry, loaded: Loaded, slot: int, defer: bool = False) -> kv.Part:
        """A chunk's KV from the RAM tier, else read (and verified) from its shard into read
        buffer `slot` (valid until the next request assembles), then kept in the RAM tier. With
        `defer`, when it can be: to be read straight into the cache, and kept in the RAM tier
        from there."""
        key = self.ram_key(entry.kv_key)
        held = self.ram.get(key)
        if held is not None:
            loaded.ram_hits += 1
            return held
        loaded.ram_misses += 1
        later = codec.deferred(self.snapshot.shards, entry, self.lm.model.dtype, self.device) if defer else None
        if later is not None:
            if later.nbytes <= self.ram.max_bytes:
                later.keep = lambda tensor: self.ram.put(key, tensor)
            return later
        buffer = self._read_buffer(slot, entry.nbytes + 64) if entry.nbytes else None  # + alignment of parts
        # The prefill that uses the KV runs after its copy on the same stream.
        read = codec.read(self.snapshot.shards, entry, self.lm.model.dtype, self.device, out=buffer)
        if read.nbytes <= self.ram.max_bytes:
            read = read.clone() if read.device.type == "cpu" else read  # own memory
            self.ram.put(key, read)
        return read

    def ram_key(self, kv_key: str) -> str:
        """The RAM tier's key for the entry `kv_key`: itself, or the isolated tenant's own."""
        return f"{kv_key}@{self.salt}" if self.salt else kv_key

    def hot(self) -> dict:
        """What the RAM tier holds, for a router that sends a document's questions where its KV
        is warm: the count, bytes and counters, and each chunk whose KV is held (its id,
        document and key; a key of identical text may serve several chunks). `computed`: KV
        held for chunks the store has none for yet (computed on a miss, not yet written back).
        Reads the catalog: call it where the engine's steps run."""
        keys = [str(key) for key in self.ram.keys() if "@" not in str(key)]  # a tenant's own are not listed
        linked = self.snapshot.catalog.entries.chunks_of_keys(self.active.profile.profile_id, keys)
        return {
            "generation": self.snapshot.generation,
            "profile_id": self.active.profile.profile_id,
            **self.ram.stats(),
            "chunks": [{"chunk_id": c, "doc_id": d, "kv_key": k} for k, c, d in linked],
            "documents": sorted({d for _, _, d in linked}),
            "computed": len(set(keys) - {k for k, _, _ in linked}),
        }

    def _read_buffer(self, slot: int, size: int) -> torch.Tensor:
        """Reused host memory to read stored KV into: one buffer per chunk of a request,
        page-locked when the model is on a GPU (so the host-to-device copy can overlap)."""
        while len(self._read_buffers) <= slot:
            self._read_buffers.append(torch.empty(0, dtype=torch.uint8))
        if self._read_buffers[slot].numel() < size:
            pinned = torch.device(self.device).type == "cuda"
            self._read_buffers[slot] = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
        return self._read_buffers[slot]

    def prefix(self) -> Entry:
        """The system-prompt entry (its KV and, for recurrent layers, the state after it), read
        once and kept."""
        if self._prefix_kv is None:
            entry = self.snapshot.catalog.entries.entry(KVKey.for_prefix(self.active.profile).to_string())
            if entry is None:
                raise StoreCorruptError("the system-prompt KV is missing from the store")
            self._prefix_kv = codec.read(self.snapshot.shards, entry, self.lm.model.dtype, self.device)
        return self._prefix_kv


def ms_since(since: float) -> float:
    return (time.perf_counter() - since) * 1000.0
