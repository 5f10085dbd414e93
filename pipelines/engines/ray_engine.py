"""`ingest --engine ray`: embeddings and KV computed by a Ray Data job, committed by the driver.

The driver reads, chunks and plans exactly as the local engine does (so the keys are the
same), then hands Ray one row per chunk that needs an embedding or KV (plus one row for the
shared prefix when the store lacks it). `map_batches` runs `KVWorker`, a stateful class that
loads the model and embedder once per actor and, per batch, embeds, computes KV after the
prefix, seals the batch's KV into one shard in the store (a shared folder, or uploaded to
object storage) and returns only small rows: vectors and the sealed entries. The driver
commits catalog rows and vectors as batches arrive and publishes one generation at the end.

Failure: a killed actor is restarted and its batch retried (bounded); the retry seals a new
shard with the same content-addressed keys, the catalog keeps one row per key, and shards
nobody references (the killed attempt's) are deleted once the generation is published.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ragkv.core.errors import InputError, MissingExtraError, ModelError
from ragkv.store.objects import is_remote

if TYPE_CHECKING:
    from ragkv.model.embed import EmbedPrompts

RETRIES = 4  # actor restarts and task retries before the job fails
DEFAULT_BATCH_ROWS = 8  # chunks per map_batches call (one shard each)


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs, picklable: what to load and what it must match."""

    model: str
    embedder: str
    embedder_prompts: EmbedPrompts
    device: str
    dtype: str
    model_fingerprint: str
    tokenizer_fingerprint: str
    prefix_ids: tuple[int, ...]
    kv_quant: str
    batch_tokens: int
    shard_metadata: dict
    shard_target: str  # a local shard folder, or an object-store URI the shards are uploaded to
    threads: int
    # Called in the worker with the entries of each shard it seals, before it reports them (the
    # crash tests install one that kills the worker there; it must pickle).
    after_seal: Callable[[list], None] | None = None


def connect(workers: int) -> tuple[int, float, float]:
    """Start or join Ray (RAY_ADDRESS joins a cluster; otherwise a local one). Returns
    (workers, CPUs per worker, GPUs per worker)."""
    try:
        import ray
    except ImportError as exc:
        raise MissingExtraError("--engine ray", "ray", "ray") from exc
    if not ray.is_initialized():
        ray.init(
            address=os.environ.get("RAY_ADDRESS") or None,
            include_dashboard=False,
            log_to_driver=False,
            logging_level=logging.WARNING,
            configure_logging=False,
        )
    resources = ray.cluster_resources()
    cpus, gpus = float(resources.get("CPU", 1)), int(resources.get("GPU", 0))
    if workers < 0:
        raise InputError(f"--workers must be positive (or 0 for one per GPU / per 2 CPUs), got {workers}")
    workers = workers or gpus or max(1, int(cpus // 2))
    if gpus:
        return workers, 1.0, 1.0
    # Fractional CPUs: Ray Data's own tasks need some, and a pool whose actors ask for every
    # CPU of a small node waits forever (measured: 2 actors x 1 CPU on a 2-CPU node hangs).
    return workers, max(0.1, (cpus - 0.5) / workers), 0.0


class KVWorker:
    """A Ray Data actor: the model and embedder loaded once, one shard sealed per batch."""

    def __init__(self, spec: WorkerSpec):
        import torch

        from ragkv.model.embed import Embedder
        from ragkv.model.forward import compute_prefix
        from ragkv.model.llm import load_model

        torch.set_num_threads(spec.threads)
        self.spec = spec
        self.lm = load_model(spec.model, spec.device, spec.dtype)
        if (self.lm.facts.fingerprint, self.lm.facts.tokenizer_fingerprint) != (
            spec.model_fingerprint,
            spec.tokenizer_fingerprint,
        ):
            raise ModelError(
                f"worker on {os.uname().nodename} loaded a different {spec.model} "
                f"(weights or tokenizer differ from the driver's): its KV would not match the keys"
            )
        self.embedder = Embedder.load(spec.embedder, spec.device, spec.embedder_prompts)
        self.prefix_kv = compute_prefix(self.lm.model, spec.prefix_ids)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from ragkv.kv import codec
        from ragkv.model.forward import compute_chunks
        from ragkv.store.kv.remote_shards import ShardSink

        n = len(batch["chunk_id"])
        vectors = np.zeros((n, self.embedder.dim), dtype=np.float32)
        embed_rows = np.flatnonzero(batch["embed"])
        if len(embed_rows):
            vectors[embed_rows] = self.embedder.embed_documents([str(batch["text"][i]) for i in embed_rows])

        sink = ShardSink(self.spec.shard_target, self.spec.shard_metadata)
        kv_rows = [i for i in range(n) if batch["key"][i] and not batch["prefix"][i]]
        for i in np.flatnonzero(batch["prefix"]):
            sink.add(str(batch["key"][i]), codec.encode(self.prefix_kv, self.spec.kv_quant))
        token_ids = [[int(t) for t in batch["token_ids"][i]] for i in kv_rows]
        for result in compute_chunks(self.lm.model, self.prefix_kv, token_ids, self.spec.batch_tokens, self.lm.pad_id):
            sink.add(str(batch["key"][kv_rows[result.index]]), codec.encode(result.kv, self.spec.kv_quant))
        sealed = {e.name: e for e in sink.seal()}
        if self.spec.after_seal is not None and sealed:
            self.spec.after_seal(list(sealed.values()))

        def field(name, default):
            return [getattr(sealed[str(k)], name) if str(k) in sealed else default for k in batch["key"]]

        return {
            "chunk_id": batch["chunk_id"],
            "embed": batch["embed"],
            "vector": vectors,
            "key": batch["key"],
            "shard": np.array(field("shard", "")),
            "num_tokens": np.array(field("num_tokens", 0), dtype=np.int64),
            "dtype": np.array(field("dtype", "")),
            "nbytes": np.array(field("nbytes", 0), dtype=np.int64),
            "checksum": np.array(field("checksum", "")),
        }


def _retry_args() -> dict:
    """Bounded fault tolerance (Ray Data's default retries forever: a batch that always kills
    its worker would hang the job)."""
    return {"max_restarts": RETRIES, "max_task_retries": RETRIES}


def run_job(rows: list[dict], spec: WorkerSpec, workers: int, cpus: float, gpus: float, batch_rows: int):
    """Run the job over `rows` and yield result batches (dicts of numpy arrays) as they finish."""
    import ray
    import ray.data

    logging.getLogger("ray.data").setLevel(logging.ERROR)  # its INFO/WARNING chatter; our bar reports
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False  # ragkv's own progress bar reports the job
    context.verbose_progress = False
    dataset = ray.data.from_items(rows, override_num_blocks=max(1, -(-len(rows) // batch_rows)))
    # Workers upload to the bucket with the driver's S3 settings (they travel in Ray's runtime env).
    aws = {k: v for k, v in os.environ.items() if k.startswith("AWS_")} if is_remote(spec.shard_target) else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # ray_remote_args_fn: no named max_restarts yet
        mapped = dataset.map_batches(
            KVWorker,
            fn_constructor_kwargs={"spec": spec},
            batch_size=batch_rows,
            batch_format="numpy",
            compute=ray.data.ActorPoolStrategy(size=workers),
            num_cpus=cpus,
            num_gpus=gpus,
            ray_remote_args_fn=_retry_args,
            runtime_env={"env_vars": aws} if aws else None,
        )
    try:
        yield from mapped.iter_batches(batch_size=None, batch_format="numpy")
    except ray.exceptions.RayError as exc:  # retries exhausted, or a worker refused to start
        cause = next((line for line in str(exc).splitlines() if "Error:" in line), str(exc).splitlines()[0])
        raise ModelError(f"the Ray job failed: {cause.strip()[:300]}") from exc
