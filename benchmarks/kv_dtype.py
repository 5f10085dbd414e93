"""Compressed KV storage (`--kv-dtype`): bytes saved, load time and fidelity against a full
prefill, on the bundled SmolLM2 computing in float32 over the sample corpus and its 20
questions (all in one run).

    python benchmarks/kv_dtype.py [--tokens 24]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import ragkv  # noqa: E402
from benchmarks.machine import describe  # noqa: E402
from benchmarks.passages import PLAIN, teacher_forced  # noqa: E402
from ragkv.core.config import AskSettings, IngestSettings, ModelSettings  # noqa: E402

QUESTIONS = (ROOT / "benchmarks" / "questions.txt").read_text().splitlines()
KV_DTYPES = ("auto", "bfloat16", "float16", "int8", "int4", "int2")


def kl(full: torch.Tensor, approx: torch.Tensor) -> float:
    p = full.log_softmax(-1)
    return float((p.exp() * (p - approx.log_softmax(-1))).sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "kv_dtype.md")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kv_dtype in KV_DTYPES:
            store = Path(tmp) / kv_dtype
            ragkv.ingest(
                [ROOT / "data"],
                store,
                model=ModelSettings(device="cpu", dtype="float32"),
                settings=IngestSettings(kv_dtype=kv_dtype),
            )
            with ragkv.open(store, device="cpu", ram_bytes=0) as engine:
                kv_bytes = engine.snapshot.catalog.reports.kv_bytes()
                engine.ask(QUESTIONS[0], max_new_tokens=1)  # warm
                whole = first8 = 0
                kls, load_ms, agreement = [], [], []
                for question in QUESTIONS:
                    answer = engine.ask(question, max_new_tokens=args.tokens)
                    full = engine.ask(question, max_new_tokens=args.tokens, use_cache=False)
                    whole += answer.token_ids == full.token_ids
                    first8 += answer.token_ids[:8] == full.token_ids[:8]
                    load_ms.append(answer.stats.kv_read_ms)
                    kls.append(
                        kl(engine.first_token_logits(question, use_cache=False), engine.first_token_logits(question))
                    )
                    greedy = engine.ask(question, max_new_tokens=args.tokens, use_cache=False, **PLAIN).token_ids
                    agreement.append(teacher_forced(engine, question, AskSettings(), greedy)[1])
                rows.append(
                    (
                        kv_dtype,
                        answer.stats.kv_quant,
                        kv_bytes,
                        statistics.median(load_ms),
                        whole,
                        first8,
                        statistics.mean(agreement),
                        statistics.mean(kls),
                        max(kls),
                    )
                )
            print(f"{kv_dtype}: done", file=sys.stderr)
    base = rows[0][2]
    lines = [
        "# Compressed KV in the store",
        "",
        f"Bundled SmolLM2-135M-Instruct computing in float32 on the CPU ({describe()}, "
        f"{torch.get_num_threads()} threads); the sample corpus and its {len(QUESTIONS)} "
        f"questions; greedy, {args.tokens} new tokens; against a full float32 prefill of the same prompt. KV read = "
        "shard read + checksum + decode to float32, RAM tier off, page cache warm (median). "
        "Command: `python benchmarks/kv_dtype.py`.",
        "",
        "| --kv-dtype | stored as | KV bytes | vs lossless | KV read ms | whole answer = full | first 8 tokens = full | "
        f"teacher-forced top-1 agreement ({args.tokens} tokens) | first-token KL mean / max |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for kv_dtype, quant, kv_bytes, load, whole, first8, agree, kl_mean, kl_max in rows:
        lines.append(
            f"| {kv_dtype} | {quant} | {kv_bytes / 2**20:.1f} MiB | {kv_bytes / base:.3f} | {load:.1f} | "
            f"{whole}/{len(QUESTIONS)} | {first8}/{len(QUESTIONS)} | {agree:.1%} | "
            f"{kl_mean:.2e} / {kl_max:.2e} |"
        )
    lines += [
        "",
        "`auto` stores KV as computed (lossless; the default). The others are approximate, opt-in, part of "
        "the cache key, and named in every answer's stats (`kv_quant`). Teacher-forced agreement: the full "
        "prefill's greedy answer (no repetition controls) fed after the stored KV; the share of positions "
        "where the stored KV's top token is the full prefill's.",
        "",
    ]
    args.out.write_text("\n".join(lines))
    print(args.out.read_text())


if __name__ == "__main__":
    main()
