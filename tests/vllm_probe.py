"""Run inside a Python that has vLLM (tests/test_vllm.py starts it): one in-process vLLM engine
with the ragkv connector, prompts given as token ids, greedy first tokens and vLLM's own
counts of the tokens it did not compute. Prints one JSON object.

    python tests/vllm_probe.py MODEL_FOLDER STORE SPEC.json     (or `run(...)` from ragkv's python)

SPEC: {"kv_role": "kv_both", "layerwise": "auto", "max_model_len": 2048, "runs": [{"name", "ids", "params", "flush"}]}:
each run is one request (`params`: its kv_transfer_params); `flush` waits, after it, until the
connector's saves are written to the store.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
HANG_GUARD_S = 600  # a probe takes a minute or two; this only turns a hang into a failure with vLLM's log


def _vllm_settings() -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of paged KV on a CPU build
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker's connector in this process: to flush it


_vllm_settings()

# The probe forked from a process that has imported vLLM already (and started no thread; on
# CPU: CUDA is never touched before the fork): each probe is still a process of its own with a
# fresh engine, and does not pay vLLM's ~10 s of imports. The job carries the caller's
# environment (a test may point RAGKV_HOME or S3 credentials elsewhere), the child's output
# goes to files, and the server answers the child's pid, then its exit code.
FORK_SERVER = """
import json, os, sys, traceback
sys.path.insert(0, {root!r})
import tests.vllm_probe as probe
import vllm, vllm.config, vllm.distributed.kv_transfer, vllm.inputs  # what every probe imports

for line in sys.stdin:
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        os.environ.clear()
        os.environ.update(job["env"])
        probe._vllm_settings()
        for fd, path in ((1, job["out"]), (2, job["err"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        sys.argv = [probe.__file__, *job["argv"]]
        code = 0
        try:
            probe.main()
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    print(pid, flush=True)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""
_servers: dict[str, subprocess.Popen] = {}


def _fork_server(python: str) -> subprocess.Popen:
    """This process's fork server in `python` (started at the first probe; it ends with us)."""
    server = _servers.get(python)
    if server is None or server.poll() is not None:
        root = str(Path(__file__).resolve().parent.parent)
        server = subprocess.Popen(
            [python, "-c", FORK_SERVER.format(root=root)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": root},
        )
        _servers[python] = server
        atexit.register(server.stdin.close)  # type: ignore[union-attr]
    return server


def run(python: str, model: str, store, spec: dict, work: Path, forked: bool = False) -> dict:
    """This script run in `python` (one with vLLM) on `spec`, from ragkv's environment: its
    result, with vLLM's log under "log". RuntimeError (with the log's tail) when it fails.
    `forked`: from a fork server that has imported vLLM (on CPU only: see FORK_SERVER)."""
    root = Path(__file__).resolve().parent.parent
    spec_file = Path(work) / "spec.json"
    spec_file.write_text(json.dumps(spec))
    argv = [str(model), str(store), str(spec_file)]
    env = {**os.environ, "PYTHONPATH": str(root)}
    if forked:
        returncode, stdout, stderr = _run_forked(python, argv, env, Path(work))
    else:
        try:
            proc = subprocess.run(
                [python, __file__, *argv], capture_output=True, text=True, env=env, timeout=HANG_GUARD_S
            )
        except subprocess.TimeoutExpired as exc:  # killed: say where vLLM was
            raise _hung(exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr) from None
        returncode, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    if returncode != 0 or not lines:
        raise RuntimeError(f"the vLLM probe failed ({returncode}): {stderr[-4000:]}")
    return {**json.loads(lines[-1].removeprefix("RESULT ")), "log": stderr}


def _hung(log: str | None) -> RuntimeError:
    return RuntimeError(f"the vLLM probe hung past {HANG_GUARD_S} s; its log ends: {(log or '')[-4000:]}")


def _run_forked(python: str, argv: list[str], env: dict, work: Path) -> tuple[int, str, str]:
    """The probe forked by the fork server: (exit code, stdout, stderr)."""
    server = _fork_server(python)
    out, err = work / "probe.out", work / "probe.err"
    assert server.stdin is not None and server.stdout is not None
    server.stdin.write(json.dumps({"argv": argv, "env": env, "out": str(out), "err": str(err)}) + "\n")
    server.stdin.flush()
    said = server.stdout.readline()
    if not said:  # its traceback is on this process's stderr
        raise RuntimeError("the vLLM probes' fork server ended before it forked the probe")
    pid = int(said)
    answer: list[str] = []
    waiting = threading.Thread(target=lambda: answer.append(server.stdout.readline()), daemon=True)  # type: ignore[union-attr]
    waiting.start()
    waiting.join(HANG_GUARD_S)
    if waiting.is_alive():  # killed: say where vLLM was
        os.kill(pid, signal.SIGKILL)
        waiting.join()
        raise _hung(err.read_text(errors="replace") if err.exists() else "")
    return int(answer[0]), out.read_text(errors="replace"), err.read_text(errors="replace")


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
