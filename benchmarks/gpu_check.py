"""GPU check of ragkv as vLLM's memory (issue 25), on one CUDA GPU, in bfloat16, in one run:
ingest on both engines, TTFT from the store against vLLM alone with the load time shown
apart, and the layer-by-layer load against the load made before the forward. Then the model
families beyond plain attention (issue 62) in ragkv's own engine on the GPU, where transformers
runs other kernels than on a CPU (flash-linear-attention, causal-conv1d, Mamba's): each tiny
family's self-test (logits at every question position and every recurrent state, stored path
against a full prefill) in float32 and bfloat16, and a float32 answer from a store against a
full prefill, token for token. Then the own engine's decode step (issue 64): the bundled SmolLM2 in
bfloat16, rows of ~850 tokens, the packed step the runner takes against the padded one at 1, 8
and 16 rows, a 31-token prompt packed into an 8-row step, and how often the two steps pick the
same next token.

    python benchmarks/gpu_check.py --vllm-python PYTHON_WITH_CUDA_VLLM [--out FILE]
    python benchmarks/gpu_check.py --families-only [--device cpu]   # the second part alone
    python benchmarks/gpu_check.py --decode-only [--device cpu]     # the third part alone

Run by benchmarks/gpu_check.sh (which bounds it to 10 minutes). Writes a markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import ragkv  # noqa: E402
from benchmarks.machine import describe  # noqa: E402
from ragkv.core.config import AskSettings, IngestSettings, ModelSettings  # noqa: E402
from tests import vllm_probe  # noqa: E402

QUESTIONS = [line.strip() for line in (ROOT / "benchmarks" / "questions.txt").read_text().splitlines() if line.strip()]
SKIP = {"ragkv": "skip"}


def ingest(store: Path, engine: str) -> dict:
    started = time.perf_counter()
    report = ragkv.ingest(
        [ROOT / "data"],
        store,
        model=ModelSettings(device="cuda", dtype="bfloat16"),
        settings=IngestSettings(),
        engine=engine,
    )
    return {"s": time.perf_counter() - started, "tokens": report.tokens_computed, "compute_s": report.compute_s}


def probe(python: str, model: str, store: Path, runs: list, work: Path, **spec) -> dict:
    try:
        return vllm_probe.run(python, model, store, {"dtype": "bfloat16", **spec, "runs": runs}, work)
    except RuntimeError as exc:
        sys.exit(str(exc))


FAMILIES = [  # beyond plain attention; vLLM's CPU build runs none of the first three
    "qwen3.5 (Gated DeltaNet + full)",
    "lfm2 (short convolutions + full)",
    "gemma4 (sliding + global of other head sizes, shared KV)",
    "nemotron-h (Mamba2 + attention + MLP layers)",
    "falcon-h1 (Mamba2 beside attention in every layer)",
]


def family_lines(device: str, work: Path) -> list[str]:
    """Each family's self-test in float32 and bfloat16 on `device`, and a float32 answer from a
    store against a full prefill (tiny random models, heads of 64 as GPU kernels take)."""
    from ragkv.model import self_check
    from ragkv.model.llm import load_model
    from tests import families
    from tests.conftest import CORPUS, QUESTIONS

    docs = work / "family-docs"
    docs.mkdir(parents=True, exist_ok=True)
    for name, text in CORPUS.items():
        (docs / name).write_text(text)
    lines = [
        "",
        f"## Model families on {device}",
        "",
        "| family | self-test float32 | self-test bfloat16 (tolerance) | float32 answer from the store = full prefill |",
        "|---|---|---|---|",
    ]
    for family in FAMILIES:
        folder = families.build(family, work / "families" / family.split()[0], head_dim=64)
        checks = []
        for dtype in ("float32", "bfloat16"):
            lm = load_model(str(folder), device, dtype)
            check = self_check.run(lm.model, lm.tokenizer, dtype, lm.pad_id)
            checks.append(f"{'pass' if check.passed else 'FAIL'} {check.difference:.1e} ({check.tolerance:.0e})")
        store = work / "family-stores" / family.split()[0]
        ragkv.ingest(
            [docs],
            store,
            model=ModelSettings(model=str(folder), device=device, dtype="float32"),
            settings=IngestSettings(chunk_tokens=24),
        )
        with ragkv.open(store, device=device) as engine:
            same = sum(
                engine.ask(q, max_new_tokens=8, top_k=2).token_ids
                == engine.ask(q, max_new_tokens=8, top_k=2, use_cache=False).token_ids
                for q in QUESTIONS
            )
        lines.append(f"| {family} | {checks[0]} | {checks[1]} | {same} of {len(QUESTIONS)} |")
        print(lines[-1], flush=True)
    return lines


def decode_lines(device: str, dtype: str = "bfloat16", steps: int = 12) -> list[str]:
    """The decode step on `device`: packed against padded, ms per step (medians), and agreement."""
    import torch

    from benchmarks.decode_profile import CONTEXT, rows_of
    from ragkv.kv.ragged import RaggedBatch
    from ragkv.model.llm import load_model

    lm = load_model("smollm2", device, dtype)

    def sync() -> None:  # a GPU runs ahead of Python: a time is read once its work is done
        if device == "cuda":
            torch.cuda.synchronize()

    def timed(step) -> float:
        times = []
        for _ in range(steps):
            sync()
            began = time.perf_counter()
            step()
            sync()
            times.append(time.perf_counter() - began)
        return 1000 * statistics.median(times[2:])

    lines = [
        "",
        f"## The own engine's decode step on {device} ({dtype})",
        "",
        f"SmolLM2-135M, rows of ~{CONTEXT}-token contexts; ms per step, medians of {steps - 2}.",
        "",
        "| rows | padded step | packed step | packed with a 31-token prompt | same next token, packed vs padded |",
        "|---|---|---|---|---|",
    ]
    for count in (1, 8, 16):
        rows = rows_of(lm, count)
        batches = [RaggedBatch(lm.model.config) for _ in range(2)]
        for batch in batches:
            for cache, _ in rows:
                batch.add(cache)
        tokens = [state.to_feed() for _, state in rows]
        padded, packed = batches
        same = int(
            (
                padded.step(lm.model, tokens).argmax(-1)
                == packed.step_packed(lm.model, [[t] for t in tokens]).argmax(-1)
            ).sum()
        )
        padded_ms = timed(lambda b=padded, t=tokens: b.step(lm.model, t))
        packed_ms = timed(lambda b=packed, t=tokens: b.step_packed(lm.model, [[x] for x in t]))
        joined = ""
        if count == 8:
            joiner = rows_of(lm, 1)[0][0]
            packed.add(joiner)
            prompt = list(range(100, 131))
            sync()  # the joiner's own prefill (rows_of) is not part of the step
            began = time.perf_counter()
            packed.step_packed(lm.model, [[t] for t in tokens] + [prompt])
            sync()
            joined = f"{1000 * (time.perf_counter() - began):.1f} (once)"
        lines.append(f"| {count} | {padded_ms:.1f} | {packed_ms:.1f} | {joined or '-'} | {same} of {count} |")
        print(lines[-1], flush=True)
    return lines + lone_lines(lm, timed)


def lone_lines(lm, timed) -> list[str]:
    """A request decoding alone: the written-out step of its one row (`direct.step_alone`, what
    the runner takes for the Llama kind) against the model's own step, on two copies of a row."""
    from benchmarks.decode_profile import rows_of
    from ragkv.kv import direct
    from ragkv.model.generate import step

    (mine, state), (own, _) = rows_of(lm, 1) + rows_of(lm, 1)
    token = state.to_feed()
    if not direct.serves_alone(lm.model, mine):
        return ["", "A lone request takes the model's own step (not of the Llama kind)."]
    same = int(direct.step_alone(lm.model, token, mine).argmax()) == int(step(lm.model, token, own).argmax())
    lone_ms = timed(lambda: direct.step_alone(lm.model, token, mine))
    own_ms = timed(lambda: step(lm.model, token, own))
    lines = ["", f"A lone request's step (one row on its own cache): {lone_ms:.1f} ms written out against "]
    lines[-1] += f"{own_ms:.1f} ms for the model's own step; the same next token: {'yes' if same else 'NO'}."
    print(lines[-1], flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gpu_check.md")
    parser.add_argument("--families-only", action="store_true", help="only the model families, no vLLM")
    parser.add_argument("--decode-only", action="store_true", help="only the own engine's decode step, no vLLM")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    if args.families_only:
        work = Path(tempfile.mkdtemp(prefix="ragkv-families-"))
        lines = [f"# Model families on {args.device}", "", f"Machine: {describe()}.", *family_lines(args.device, work)]
        args.out.write_text("\n".join(lines) + "\n")
        print(args.out.read_text())
        return
    if args.decode_only:
        lines = [f"# The own engine's decode step on {args.device}", "", f"Machine: {describe()}."]
        lines += decode_lines(args.device, "bfloat16" if args.device == "cuda" else "float32")
        args.out.write_text("\n".join(lines) + "\n")
        print(args.out.read_text())
        return
    if not args.vllm_python:
        parser.error("--vllm-python is required (or --families-only, --decode-only)")
    os.environ["RAGKV_VLLM_PYTHON"] = args.vllm_python
    work = Path(tempfile.mkdtemp(prefix="ragkv-gpu-"))
    ingests = {"local": ingest(work / "local", "ragkv"), "vllm": ingest(work / "vllm", "vllm")}
    runs = []
    with ragkv.open(work / "local", device="cpu", weights=False) as engine:
        model = engine.lm.facts.path
        for i, question in enumerate(QUESTIONS[:16]):
            prompt = engine.prompt_for(question, AskSettings(top_k=1, context="document"))
            runs += [
                {"name": f"q{i}", "ids": prompt.prompt_ids},
                {"name": f"q{i}-full", "ids": prompt.prompt_ids, "params": SKIP},
            ]
    results = {
        mode: probe(args.vllm_python, model, work / "local", runs, work, layerwise=mode == "layer-by-layer")
        for mode in ("before the forward", "layer-by-layer")
    }
    lines = [
        "# GPU check: ragkv as vLLM's memory (bfloat16)",
        "",
        f"Machine: {describe()}.",
        "",
        "| ingest engine | total s | chunk tokens | KV compute s | tokens/s |",
        "|---|---|---|---|---|",
    ]
    for name, row in ingests.items():
        tps = row["tokens"] / row["compute_s"] if row["compute_s"] else 0
        lines.append(f"| {name} | {row['s']:.1f} | {row['tokens']:,} | {row['compute_s']:.2f} | {tps:.0f} |")
    lines += [
        "",
        "| vLLM load | prompt tokens p50 | TTFT from store p50 ms | vLLM alone p50 ms | ratio | "
        "shard read p50 ms | copies issued p50 ms | same first token |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mode, result in results.items():
        by = {r["name"]: r for r in result["runs"]}
        names = [n for n in by if not n.endswith("-full")][1:]  # the first request warms up
        stored = [by[n]["seconds"] * 1000 for n in names]
        alone = [by[f"{n}-full"]["seconds"] * 1000 for n in names]
        reads = [r for r, _ in result["load_ms"][1:]] or [0.0]
        issues = [i for _, i in result["load_ms"][1:]] or [0.0]
        same = sum(by[n]["first_token"] == by[f"{n}-full"]["first_token"] for n in names)
        lines.append(
            f"| {mode} | {statistics.median(by[n]['num_prompt_tokens'] for n in names):.0f} | "
            f"{statistics.median(stored):.1f} | {statistics.median(alone):.1f} | "
            f"{statistics.median(stored) / statistics.median(alone):.2f}x | {statistics.median(reads):.1f} | "
            f"{statistics.median(issues):.1f} | {same} of {len(names)} |"
        )
    lines += [
        "",
        "Overlap: layer-by-layer issues each layer's host-to-device copy on a side stream and the forward "
        "waits per layer; the difference in TTFT between the two rows is what the overlap saved. `copies issued` "
        "is host time to start the copies (layer-by-layer) or to make them (before the forward): its share of "
        "the TTFT is the load's cost on the critical path.",
    ]
    lines += family_lines(args.device, work)
    lines += decode_lines(args.device)
    args.out.write_text("\n".join(lines) + "\n")
    print(args.out.read_text())


if __name__ == "__main__":
    main()
