"""`ragkv ingest --engine vllm`: reading, chunking, embedding, the budget's plan and the prefix's
KV run here as for `--engine ragkv`, and the store is published with the planned chunks' KV
still to compute; then vLLM's offline engine, in the python that has vLLM (`RAGKV_VLLM_PYTHON`,
else this one), prefills each planned sequence (a chunk alone, or a span from its start) and
the ragkv connector stores the KV the store lacks (ragkv.integrations.vllm_fill), keyed as
ingest keys it, through the write-back (so a budget still decides what stays), as the store's
one writer (on S3 too: vLLM's process takes the bucket's lock for each batch it publishes). A failure in
that second half leaves a complete store whose chunks have their KV computed on a miss (by
either engine), and says so.

The engine that computed a KV is recorded in its shard's header, not in its key: the key
names what the KV is of (weights, tokenizer, template, position, dtype, quantisation), and
two engines' kernels agree within float tolerance on it (measured: benchmarks/vllm_memory.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from ragkv.core.errors import InputError, ModelError
from ragkv.core.install import import_path
from ragkv.kv.movable import refuse_unless_movable
from ragkv.pipelines.to_compute import Unit
from ragkv.store import open_snapshot
from ragkv.store.objects import absolute

VLLM_PYTHON_ENV = "RAGKV_VLLM_PYTHON"


def python() -> str:
    return os.environ.get(VLLM_PYTHON_ENV) or sys.executable


def check(store, settings) -> None:
    """Refuse, before any work, what the vLLM engine does not do yet (one line each)."""
    found = subprocess.run([python(), "-c", "import vllm"], capture_output=True, text=True)
    if found.returncode != 0:
        raise InputError(
            f"--engine vllm: {python()} has no vllm (set {VLLM_PYTHON_ENV} or --vllm-python to a python "
            "that has it; bash tests/vllm_env.sh .venv-vllm makes one)"
        )


def fill(store, model_folder: str | Path, dtype: str, units: Sequence[Unit], report) -> None:
    """Compute the KV of `units` (what ingest planned) with vLLM; updates `report`'s counts."""
    refuse_unless_movable(model_folder, saves=True)  # before vLLM starts: an ingest saves what vLLM computes
    if not units:
        return
    root = import_path()  # so vLLM's python imports this ragkv
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    planned = [{"chunks": [[c.chunk_id, len(c.token_ids)] for c in u.chunks], "ids": u.ids} for u in units]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as file:
        json.dump(planned, file)
    try:
        proc = subprocess.run(
            [
                python(),
                "-m",
                "ragkv.integrations.vllm_fill",
                absolute(store),
                str(model_folder),
                dtype,
                file.name,
            ],
            stdout=subprocess.PIPE,
            stderr=None,
            text=True,
            env=env,
        )
    finally:
        os.unlink(file.name)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise ModelError(
            f"vLLM did not compute the chunks' KV (exit {proc.returncode}; its log is above); the store "
            "is published with their KV deferred: it is computed on each chunk's first miss"
        )
    result = json.loads(lines[-1].removeprefix("RESULT "))
    report.kv_computed += result["stored"]
    report.kv_deferred = max(report.kv_deferred - result["stored"], 0)
    report.tokens_computed += result["tokens"]
    report.compute_s += result.get("compute_s", 0.0)  # vLLM's prefill and the copies out; not its start
    with open_snapshot(store) as snapshot:
        report.kv_bytes = snapshot.catalog.reports.kv_bytes()
        report.generation = snapshot.generation
