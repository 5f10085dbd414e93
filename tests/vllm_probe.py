"""Run inside a Python that has vLLM (tests/test_vllm.py starts it): one in-process vLLM engine
with the ragkv connector, prompts given as token ids, greedy first tokens and vLLM's own
counts of the tokens it did not compute. Prints one JSON object.

    python tests/vllm_probe.py MODEL_FOLDER STORE SPEC.json     (or `run(...)` from ragkv's python)

SPEC: {"kv_role": "kv_both", "layerwise": "auto", "max_model_len": 2048, "runs": [{"name", "ids", "params", "flush"}]}:
each run is one request (`params`: its kv_transfer_params); `flush` waits, after it, until the
connector's saves are written to the store.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of paged KV on a CPU build
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker's connector in this process: to flush it
HANG_GUARD_S = 600  # a probe takes a minute or two; this only turns a hang into a failure with vLLM's log


def run(python: str, model: str, store, spec: dict, work: Path) -> dict:
    """This script run in `python` (one with vLLM) on `spec`, from ragkv's environment: its
    result, with vLLM's log under "log". RuntimeError (with the log's tail) when it fails."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    spec_file = Path(work) / "spec.json"
    spec_file.write_text(json.dumps(spec))
    try:
        proc = subprocess.run(
            [python, str(Path(__file__).resolve()), str(model), str(store), str(spec_file)],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(root)},
            timeout=HANG_GUARD_S,
        )
    except subprocess.TimeoutExpired as exc:  # killed: say where vLLM was
        said = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr or ""
        raise RuntimeError(f"the vLLM probe hung past {HANG_GUARD_S} s; its log ends: {said[-4000:]}") from None
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"the vLLM probe failed ({proc.returncode}): {proc.stderr[-4000:]}")
    return {**json.loads(lines[-1].removeprefix("RESULT ")), "log": proc.stderr}


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.inputs import TokensPrompt

    model, store, spec_file = sys.argv[1:4]
    spec = json.loads(Path(spec_file).read_text())
    config = KVTransferConfig(
        kv_connector="RagkvConnector",
        kv_connector_module_path="ragkv.integrations.vllm",
        kv_role=spec.get("kv_role", "kv_consumer"),
        kv_connector_extra_config={"store": store, "layerwise": spec.get("layerwise", "auto")},
    )
    started = time.perf_counter()
    llm = LLM(
        model=model,
        dtype=spec.get("dtype", "float32"),
        kv_transfer_config=config,
        enable_prefix_caching=False,
        max_model_len=spec.get("max_model_len", 2048),
        max_num_seqs=4,
        enforce_eager=spec.get("enforce_eager", True),
        seed=0,
    )
    out = {
        "start_s": time.perf_counter() - started,
        "runs": [],
        "block_size": llm.llm_engine.vllm_config.cache_config.block_size,
    }
    connector = get_kv_transfer_group()
    for run in spec["runs"]:
        params = SamplingParams(
            max_tokens=1,
            temperature=0.0,
            logprobs=5,
            extra_args={"kv_transfer_params": run["params"]} if run.get("params") else None,
        )
        began = time.perf_counter()
        (result,) = llm.generate([TokensPrompt(prompt_token_ids=run["ids"])], params, use_tqdm=False)
        completion = result.outputs[0]
        out["runs"].append(
            {
                "name": run["name"],
                "num_prompt_tokens": len(run["ids"]),
                "first_token": completion.token_ids[0],
                "num_cached_tokens": result.num_cached_tokens,
                "logprobs": {str(k): v.logprob for k, v in completion.logprobs[0].items()},
                "seconds": time.perf_counter() - began,
            }
        )
        if run.get("flush"):
            connector.flush()
    out["layer_waits"] = connector.layer_waits
    kv_cache_config = getattr(connector, "_kv_cache_config", None)
    out["kv_cache_groups"] = [  # [sliding window or None, layers] per group of vLLM's allocator
        [getattr(group.kv_cache_spec, "sliding_window", None), len(group.layer_names)]
        for group in (kv_cache_config.kv_cache_groups if kv_cache_config is not None else [])
    ]
    out["hybrid_allocator"] = not llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
    out["load_ms"] = list(connector.load_ms)
    saver = connector._saver
    out["copy_ms"] = list(saver.copy_ms) if saver is not None else []
    out["write_back"] = vars(saver.write_back.report) if saver is not None else None
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
