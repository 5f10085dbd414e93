"""One decode step of ragkv's own engine against vLLM's CPU build, on the same contexts, in one
run (issue 64: measure first, the peer too).

Rows of ~850 random token ids each (the same ids for both), already in the cache, then each row
decoded one token per step:
- ragkv: the continuous batch's packed step (`RaggedBatch.step_packed`, as the runner takes it:
  the Llama kind's layers written out, `ragkv.kv.direct`) plus each row's greedy pick, medians over
  the steps after two warm-up ones;
- vLLM: its offline `LLM` (float32, prefix caching on, as compiled and threaded as it serves), per
  step time = (the wall time of `generate` for 1 + S new tokens - that for 1 new token) / S, the
  prompts' prefill a prefix-cache hit in both (medians of 3).
The systems run one at a time: ragkv, vLLM, ragkv again (this machine drifts; both ragkv runs are
shown). Each row count gets its own ids.

    python benchmarks/step_against_vllm.py --vllm-python .venv-vllm/bin/python [--rows 1,8,16] [--steps 32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "step_against_vllm.md"


def ragkv_steps(lm, ids: list[list[int]], steps: int) -> float:
    """Median ms of ragkv's packed step over `ids`' rows, each row's greedy pick included."""
    import torch

    from benchmarks.decode_profile import rows_of
    from ragkv.kv.ragged import RaggedBatch

    batch = RaggedBatch(lm.model.config)
    tokens = []
    for cache, state in rows_of(lm, len(ids), ids):
        tokens.append(state.to_feed())
        batch.add(cache)
    times = []
    for step in range(steps + 2):
        began = time.perf_counter()
        with torch.inference_mode():
            logits = batch.step_packed(lm.model, [[token] for token in tokens])
        tokens = [int(row.argmax()) for row in logits]
        if step >= 2:
            times.append((time.perf_counter() - began) * 1000)
    return statistics.median(times)


def vllm_side(model: str, spec_file: str) -> None:
    """Run in vLLM's Python: print each row count's ms per decode step as JSON."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.loads(Path(spec_file).read_text())
    llm = LLM(model=model, dtype="float32", enable_prefix_caching=True, max_model_len=2048, max_num_seqs=32, seed=0)
    steps = spec["steps"]
    found = {}
    for rows, ids in spec["contexts"].items():
        prompts = [TokensPrompt(prompt_token_ids=row) for row in ids]
        one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        many = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
        llm.generate(prompts, one, use_tqdm=False)  # the prefix cache holds the contexts from here
        short, long = [], []
        for _ in range(3):
            began = time.perf_counter()
            llm.generate(prompts, one, use_tqdm=False)
            short.append(time.perf_counter() - began)
            began = time.perf_counter()
            llm.generate(prompts, many, use_tqdm=False)
            long.append(time.perf_counter() - began)
        found[rows] = 1000 * (statistics.median(long) - statistics.median(short)) / steps
    print("RESULT " + json.dumps(found), flush=True)


def vllm_steps(python: str, model: Path, spec: dict) -> dict[str, float]:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2"}
    done = subprocess.run(
        [python, __file__, "--vllm-side", str(model), f.name], capture_output=True, text=True, env=env, cwd=ROOT
    )
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"vLLM failed:\n{done.stderr[-3000:]}")
    return json.loads(line[len("RESULT ") :])


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--vllm-side":
        return vllm_side(sys.argv[2], sys.argv[3])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", required=True, help="python of a venv with vllm-cpu")
    parser.add_argument("--rows", default="1,8,16")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    import torch

    from benchmarks.decode_profile import CONTEXT, context_ids
    from benchmarks.machine import describe
    from ragkv.model.llm import bundled_smollm2_path, load_model

    torch.set_num_threads(2)
    counts = [int(c) for c in args.rows.split(",")]
    ids = {str(c): context_ids(c, seed=c) for c in counts}
    lm = load_model("smollm2", "cpu", "float32")
    first = {c: ragkv_steps(lm, ids[c], args.steps) for c in ids}
    theirs = vllm_steps(args.vllm_python, bundled_smollm2_path(), {"steps": args.steps, "contexts": ids})
    again = {c: ragkv_steps(lm, ids[c], args.steps) for c in ids}
    lines = [
        "# One decode step: ragkv's own engine against vLLM's CPU build",
        "",
        f"Generated by `python benchmarks/step_against_vllm.py --rows {args.rows} --steps {args.steps}` on "
        f"{describe()}. SmolLM2-135M-Instruct, float32; rows of ~{CONTEXT} random token ids (the same for both), "
        f"already cached, each decoded one token per step for {args.steps} steps. *ragkv*: the continuous batch's "
        "packed step with each row's greedy pick (median step; run before and after vLLM). *vLLM*: its offline "
        "`LLM` (vllm-cpu, torch.compile'd, one torch thread as it serves on 2 cores, its engine core in a process "
        "of its own), per step: (wall time of `generate` for 1 + S tokens - for 1 token) / S, prefix cache warm "
        "(medians of 3). One system at a time.",
        "",
        "| rows | ragkv ms (first) | vLLM ms | ragkv ms (again) | vLLM / ragkv (median of ragkv's) |",
        "|---|---|---|---|---|",
    ]
    for c in ids:
        ours = statistics.median([first[c], again[c]])
        lines.append(f"| {c} | {first[c]:.1f} | {theirs[c]:.1f} | {again[c]:.1f} | {theirs[c] / ours:.2f}x |")
    lines.append("")
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
