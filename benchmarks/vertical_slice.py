"""Measure the vertical slice on the bundled SmolLM2 and the sample corpus, side by side in
one run (absolute times on shared machines drift; ratios are what to read):

- ingest throughput: `ragkv ingest` tokens/s vs a bare model forward over the same chunks;
- time to first token, cached vs `--no-cache` (full prefill of the same prompt), median of
  repeats, interleaved, after a warm-up;
- float32 and bfloat16: greedy agreement of cached vs full prefill over 20 questions x 48 tokens,
  and the largest first-token logit difference.

    python benchmarks/vertical_slice.py [--repeats 5] [--out benchmarks/results/vertical_slice.md]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import ragkv  # noqa: E402
from benchmarks.machine import describe  # noqa: E402
from ragkv.core.config import IngestSettings, ModelSettings  # noqa: E402
from ragkv.model.forward import compute_chunks, compute_prefix  # noqa: E402
from ragkv.model.prompt import encode_text  # noqa: E402
from ragkv.pipelines.reading.chunk import chunk_text  # noqa: E402
from ragkv.pipelines.reading.read import read_documents  # noqa: E402

QUESTIONS = (Path(__file__).parent / "questions.txt").read_text().splitlines()


def bare_forward_tokens_per_s(engine, settings: IngestSettings) -> float:
    """The limit for ingest: model forwards alone over the same chunks and batches."""
    lm, layout = engine.lm, engine.active.layout
    docs = read_documents([ROOT / "data"]).documents
    chunks = [
        encode_text(lm.tokenizer, c) for d in docs for c in chunk_text(d.text, lm.tokenizer, settings.chunk_tokens)
    ]
    start = time.perf_counter()
    prefix = compute_prefix(lm.model, layout.prefix_ids)
    for _ in compute_chunks(lm.model, prefix, chunks, settings.batch_tokens_for("cpu"), lm.pad_id):
        pass
    return sum(map(len, chunks)) / (time.perf_counter() - start)


def ttft(engine, repeats: int) -> list[dict]:
    rows = []
    for question in QUESTIONS[:5]:
        engine.ask(question, max_new_tokens=1)  # warm-up: retrieval, shard pages, kernels
        cached, full = [], []
        for _ in range(repeats):
            cached.append(engine.ask(question, max_new_tokens=1).stats)
            full.append(engine.ask(question, max_new_tokens=1, use_cache=False).stats)
        rows.append(
            {
                "question": question,
                "prompt_tokens": cached[0].prompt_tokens,
                "reused": cached[0].reused_tokens,
                "cached_s": statistics.median(s.ttft_s for s in cached),
                "cached_spread": (min(s.ttft_s for s in cached), max(s.ttft_s for s in cached)),
                "full_s": statistics.median(s.ttft_s for s in full),
                "full_spread": (min(s.ttft_s for s in full), max(s.ttft_s for s in full)),
                "kv_load_ms": statistics.median(s.kv_load_ms for s in cached),
                "retrieval_ms": statistics.median(s.retrieval_ms for s in cached),
                "prefill_ms": statistics.median(s.prefill_ms for s in cached),
            }
        )
    return rows


def agreement(engine, num_tokens: int = 48) -> dict:
    identical, first_diverged, max_logit_diff = 0, [], 0.0
    for question in QUESTIONS:
        cached = engine.ask(question, max_new_tokens=num_tokens).token_ids
        full = engine.ask(question, max_new_tokens=num_tokens, use_cache=False).token_ids
        if cached == full:
            identical += 1
        else:
            first_diverged.append(
                next(
                    (i for i, (a, b) in enumerate(zip(cached, full, strict=False)) if a != b),
                    min(len(cached), len(full)),
                )
            )
        diff = (engine.first_token_logits(question) - engine.first_token_logits(question, use_cache=False)).abs().max()
        max_logit_diff = max(max_logit_diff, diff.item())
    return {
        "identical": identical,
        "total": len(QUESTIONS),
        "first_diverged": first_diverged,
        "max_logit_diff": max_logit_diff,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "vertical_slice.md")
    args = parser.parse_args()
    settings = IngestSettings()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in ("float32", "bfloat16"):
            store = Path(tmp) / dtype
            report = ragkv.ingest(
                [ROOT / "data"], store, model=ModelSettings(device="cpu", dtype=dtype), settings=settings
            )
            with ragkv.open(store, device="cpu") as engine:
                bare = bare_forward_tokens_per_s(engine, settings)
                results[dtype] = {
                    "report": report,
                    "bare": bare,
                    "ttft": ttft(engine, args.repeats),
                    "agreement": agreement(engine),
                }
            print(f"{dtype}: done", file=sys.stderr)
    args.out.write_text(render(results, args.repeats))
    print(args.out.read_text())


def render(results: dict, repeats: int) -> str:
    lines = [
        "# Vertical slice: bundled SmolLM2-135M on the sample corpus (CPU)",
        "",
        f"Machine: {describe()}, {torch.get_num_threads()} torch threads; torch {torch.__version__}, "
        f"python {platform.python_version()}. Command: `python benchmarks/vertical_slice.py --repeats {repeats}`.",
        "",
        "## Ingest throughput (the sample corpus, `--chunk-tokens 512`)",
        "",
        "| dtype | chunks | tokens | ingest KV tokens/s | bare forward tokens/s | ingest / bare | ingest wall (s, incl. model load, embedding, store) |",
        "|---|---|---|---|---|---|---|",
    ]
    for dtype, r in results.items():
        rep = r["report"]
        lines.append(
            f"| {dtype} | {rep.kv_computed} | {rep.tokens_computed:,} | {rep.tokens_per_s:,.0f} | {r['bare']:,.0f} | "
            f"{rep.tokens_per_s / r['bare']:.2f} | {rep.total_s:.1f} |"
        )
    lines += [
        "",
        f"## Time to first token, cached vs full prefill (median of {repeats}, warm, interleaved)",
        "",
        "| dtype | question | prompt tokens | reused | full TTFT (s) | cached TTFT (s) | full / cached | "
        "retrieval ms | KV load ms | prefill ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for dtype, r in results.items():
        for row in r["ttft"]:
            lines.append(
                f"| {dtype} | {row['question']} | {row['prompt_tokens']} | {row['reused']} | "
                f"{row['full_s']:.3f} ({row['full_spread'][0]:.3f}–{row['full_spread'][1]:.3f}) | "
                f"{row['cached_s']:.3f} ({row['cached_spread'][0]:.3f}–{row['cached_spread'][1]:.3f}) | "
                f"{row['full_s'] / row['cached_s']:.2f}× | {row['retrieval_ms']:.0f} | {row['kv_load_ms']:.1f} | "
                f"{row['prefill_ms']:.0f} |"
            )
    lines += [
        "",
        "## Agreement of cached vs full prefill (20 questions, 48 greedy tokens)",
        "",
        "| dtype | identical answers | first differing token (diverged answers) | max first-token logit diff |",
        "|---|---|---|---|",
    ]
    for dtype, r in results.items():
        a = r["agreement"]
        lines.append(
            f"| {dtype} | {a['identical']}/{a['total']} | {a['first_diverged'] or '-'} | {a['max_logit_diff']:.2e} |"
        )
    lines += [
        "",
        "float32 identity is a guarantee (and a test); bfloat16 agreement is a measurement: a prefill split",
        "in two rounds runs matmuls of other shapes than one long prefill, which round differently in bf16.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
