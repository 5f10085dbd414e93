"""The driver side of `ingest --engine ray`: what the workers (ragkv.pipelines.engines.ray_engine) are sent,
and committing what they send back."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from ragkv.core.config import IngestSettings, ModelSettings
from ragkv.core.keys import Profile
from ragkv.kv.codec import shard_metadata
from ragkv.model.embed import EmbedPrompts
from ragkv.model.llm import LoadedModel
from ragkv.pipelines.engines import ray_engine
from ragkv.pipelines.progress import Reporter
from ragkv.store import ChunkRow, SealedEntry, StoreWriter

AFTER_SEAL = None  # a hook each worker runs after sealing a shard (see WorkerSpec.after_seal): tests set it


@dataclass
class RayOutcome:
    kv_computed: int = 0
    tokens_computed: int = 0
    compute_s: float = 0.0


@dataclass(frozen=True)
class RayJob:
    workers: int
    cpus: float  # per worker
    gpus: float  # per worker
    model: ModelSettings  # what the workers load and where (the driver plans on the CPU)


def run_ray_job(
    job: RayJob,
    writer: StoreWriter,
    to_embed: list[ChunkRow],
    work: list,
    prefix_key: str | None,
    lm: LoadedModel,
    profile: Profile,
    settings: IngestSettings,
    vectors,
    reporter: Reporter,
    embedder_prompts: EmbedPrompts,
) -> RayOutcome:
    """Embed `to_embed` (with `embedder_prompts`, the store's) and compute `work` (ingest's
    pending chunks, and the prefix when `prefix_key`) on Ray; commit what comes back to
    `writer`'s catalog and `vectors`."""
    outcome = RayOutcome()
    rows = _rows(to_embed, work, prefix_key)
    if not rows:
        return outcome
    spec = ray_engine.WorkerSpec(
        model=job.model.model,
        embedder=job.model.embedder,
        embedder_prompts=embedder_prompts,
        device=job.model.device,
        dtype=job.model.dtype,
        model_fingerprint=profile.model_fingerprint,
        tokenizer_fingerprint=profile.tokenizer_fingerprint,
        prefix_ids=tuple(profile.prefix_ids),
        kv_quant=profile.kv_quant,
        batch_tokens=settings.batch_tokens_for(job.model.device),
        shard_metadata=shard_metadata(profile.profile_id, lm.facts.name, profile.dtype),
        shard_target=writer.location,
        threads=max(1, math.ceil(job.cpus - 0.01)) if not job.gpus else 1,  # the CPUs each actor was given
        after_seal=AFTER_SEAL,
    )
    tokens = {p.key: len(p.token_ids) for p in work}
    reporter.stage("embed + KV", len(rows))
    started = time.perf_counter()
    for batch in ray_engine.run_job(
        list(rows.values()), spec, job.workers, job.cpus, job.gpus, ray_engine.DEFAULT_BATCH_ROWS
    ):
        embedded = np.flatnonzero(batch["embed"])
        if len(embedded):
            vectors.add([int(batch["chunk_id"][i]) for i in embedded], batch["vector"][embedded])
        entries = _sealed(batch)
        writer.catalog.entries.add_entries(profile.profile_id, entries, {prefix_key} if prefix_key else set())
        computed = [tokens[e.name] for e in entries if e.name in tokens]
        outcome.kv_computed += len(computed)
        outcome.tokens_computed += sum(computed)
        reporter.advance(len(batch["chunk_id"]), tokens=sum(computed))
    outcome.compute_s = time.perf_counter() - started  # the whole job: embedding, KV, shard writes
    return outcome


def _rows(to_embed: list[ChunkRow], work: list, prefix_key: str | None) -> dict[int, dict]:
    """The job's input rows by chunk id: chunks to embed, chunks whose KV to compute (both,
    for a new chunk), and the prefix (-1) when `prefix_key`."""
    rows: dict[int, dict] = {
        c.chunk_id: {"chunk_id": c.chunk_id, "text": c.text, "embed": True, "key": "", "token_ids": [], "prefix": False}
        for c in to_embed
    }
    for p in work:
        row = rows.setdefault(p.chunk_id, {"chunk_id": p.chunk_id, "text": p.text, "embed": False, "prefix": False})
        row.update(key=p.key, token_ids=list(p.token_ids))
    if prefix_key:
        rows[-1] = {"chunk_id": -1, "text": "", "embed": False, "key": prefix_key, "token_ids": [], "prefix": True}
    return rows


def _sealed(batch: dict) -> list[SealedEntry]:
    """The entries a batch of the job's output sealed into shards (a row without a shard has no KV)."""
    fields = ("key", "shard", "num_tokens", "dtype", "nbytes", "checksum")
    kinds = (str, str, int, str, int, str)
    return [
        SealedEntry(*(kind(batch[name][i]) for name, kind in zip(fields, kinds, strict=True)))
        for i in range(len(batch["key"]))
        if batch["shard"][i]
    ]
