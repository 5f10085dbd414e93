"""Where a decode step of ragkv's own engine spends its time (issue 64: measure first).

The bundled SmolLM2-135M in float32, B rows (1, 8, 16) of ~850-token contexts held in the
continuous batch (`ragkv.kv.ragged.RaggedBatch`, as `ragkv serve` decodes them), stepped one token
per row (a packed step, `step_packed`, as the runner steps a plain attention model; `--padded`:
the padded step other layouts take); each step's wall time split by torch's profiler into what
runs under it: attention, the padding mask, the linear layers, the other modules, the cache
writes, and the rest (Python between the ops), and, outside the forward, picking each row's
token (`Decoder` and the text stream, as the runner does). Medians over the steps after a
warm-up. Then what a joining prompt (31 tokens over its own ~850-token context) costs at 8 rows:
packed into the decode step, against its own prefill beside the step.

    python benchmarks/decode_profile.py [--steps 24] [--rows 1,8,16] [--padded]   # writes results/decode_profile.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from contextlib import nullcontext
from pathlib import Path
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.machine import describe  # noqa: E402
from ragkv.core.config import DecodeSettings  # noqa: E402
from ragkv.kv import cache as kv  # noqa: E402
from ragkv.kv import direct  # noqa: E402
from ragkv.kv.packed import packable  # noqa: E402
from ragkv.kv.ragged import RaggedBatch  # noqa: E402
from ragkv.model.generate import prefill, start_decoding  # noqa: E402
from ragkv.model.llm import load_model  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "decode_profile.md"
CONTEXT = 850

# torch profiler op names -> what they are in a decode step
KINDS = {
    "attention": ("scaled_dot_product_attention", "_scaled_dot_product", "flash_attention", "bmm", "softmax"),
    "mask": ("masking_utils", "create_causal_mask", "sdpa_mask", "_preprocess_mask", "padding_mask"),
    "linear": ("aten::linear", "aten::addmm", "aten::mm", "aten::matmul"),
    "cache writes": ("aten::index_put", "aten::copy_", "aten::index"),
}


def context_ids(count: int, seed: int = 0) -> list[list[int]]:
    """`count` contexts of ~CONTEXT random ids each (lengths differ a little, as prompts do)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 40000, (CONTEXT - 8 + i % 16,), generator=generator).tolist() for i in range(count)]


def rows_of(lm, count: int, contexts: list[list[int]] | None = None) -> list:
    """`count` batch-1 caches of `contexts` (by default `context_ids(count)`), prefilled, with
    their first token picked."""
    rows = []
    for ids in contexts or context_ids(count):
        cache = kv.to_cache_empty(lm.model.config)
        logits = prefill(lm.model, ids, cache)
        state = start_decoding(lm, 10_000, DecodeSettings(), time.perf_counter())
        state.take(logits)
        rows.append((cache, state))
    return rows


def stepper(lm, batch: RaggedBatch, padded: bool):
    """The step the runner takes: `step(tokens)` -> logits `(B, V)`."""
    if padded or not packable(lm.model):
        return lambda tokens: batch.step(lm.model, tokens)
    return lambda tokens: batch.step_packed(lm.model, [[token] for token in tokens])


def profile_rows(lm, count: int, steps: int, padded: bool) -> dict[str, float]:
    """Median ms per step of each kind, for `count` rows."""
    rows = rows_of(lm, count)
    batch = RaggedBatch(lm.model.config)
    for cache, _ in rows:
        batch.add(cache)
    run_step = stepper(lm, batch, padded)
    samples: dict[str, list[float]] = defaultdict(list)
    for step in range(steps + 3):
        began = time.perf_counter()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=False) as prof:
            with torch.profiler.record_function("forward"):
                logits = run_step([state.to_feed() for _, state in rows])
            with torch.profiler.record_function("pick"):
                for i, (_, state) in enumerate(rows):
                    state.take(logits[i])
        wall = (time.perf_counter() - began) * 1000
        if step < 3:  # warm-up
            continue
        spent = defaultdict(float)
        events = prof.key_averages()
        total = {e.key: e.cpu_time_total / 1000 for e in events}  # ms, inclusive
        own = {e.key: e.self_cpu_time_total / 1000 for e in events}  # ms, exclusive
        for kind, names in KINDS.items():
            spent[kind] = sum(t for key, t in own.items() if any(n in key for n in names))
        spent["pick (Decoder, text)"] = total.get("pick", 0.0)
        forward = total.get("forward", wall)
        spent["other ops"] = max(
            sum(own.values()) - sum(spent.values()) - own.get("pick", 0) - own.get("forward", 0), 0
        )
        spent["python between ops"] = max(forward - sum(v for k, v in spent.items() if k != "pick (Decoder, text)"), 0)
        spent["step (wall, profiled)"] = wall
        for kind, ms in spent.items():
            samples[kind].append(ms)
    unprofiled = []
    for _ in range(steps):  # the same steps without the profiler's own cost
        began = time.perf_counter()
        logits = run_step([state.to_feed() for _, state in rows])
        for i, (_, state) in enumerate(rows):
            state.take(logits[i])
        unprofiled.append((time.perf_counter() - began) * 1000)
    result = {kind: statistics.median(values) for kind, values in samples.items()}
    result["step (wall)"] = statistics.median(unprofiled)
    result["tokens/s"] = count / (result["step (wall)"] / 1000)
    return result


def joining(lm, rows: int, repeats: int = 9) -> dict[str, float]:
    """Median ms, at `rows` rows: a decode step; the step with a 31-token prompt packed in (its
    row joined holding its context); the prompt's own prefill over that context (before
    packing, it ran beside the step)."""
    generator = torch.Generator().manual_seed(1)
    context = torch.randint(10, 40000, (CONTEXT,), generator=generator).tolist()
    prompt = torch.randint(10, 40000, (31,), generator=generator).tolist()
    times: dict[str, list[float]] = defaultdict(list)
    for _ in range(repeats):
        batch = RaggedBatch(lm.model.config)
        for cache, _ in rows_of(lm, rows):
            batch.add(cache)
        joiner = kv.to_cache_empty(lm.model.config)
        prefill(lm.model, context, joiner)
        began = time.perf_counter()
        batch.step_packed(lm.model, [[5]] * rows)
        times["decode step"].append(time.perf_counter() - began)
        began = time.perf_counter()
        prefill(lm.model, prompt, kv.to_cache([kv.from_cache(joiner)], lm.model.config))
        times["the prompt's own prefill"].append(time.perf_counter() - began)
        batch.add(joiner)
        began = time.perf_counter()
        batch.step_packed(lm.model, [[5]] * rows + [prompt])
        times["decode step with the prompt packed in"].append(time.perf_counter() - began)
    return {kind: 1000 * statistics.median(values[2:]) for kind, values in times.items()}


def written_out_against_own(lm, counts: list[int], steps: int) -> list[tuple[str, float, float, bool]]:
    """Per row count, and with a 31-token prompt joining 8 rows: the packed step's median ms
    through `ragkv.kv.direct` (the Llama kind's forward written out) and through the model's
    own forward, stepped alternately on two batches of the same rows; whether every step's
    logits were bitwise equal."""
    generator = torch.Generator().manual_seed(2)
    prompt = torch.randint(10, 40000, (31,), generator=generator).tolist()
    joiner = rows_of(lm, 1)[0][0]
    found = []
    for count, joins in [*((c, False) for c in counts), (8, True)]:
        caches = [cache for cache, _ in rows_of(lm, count)]

        def fresh(caches=caches, joins=joins) -> RaggedBatch:
            batch = RaggedBatch(lm.model.config)
            for cache in [*caches, *([joiner] if joins else [])]:
                batch.add(cache)  # copied: the caches stay as they were
            return batch

        batches = [fresh(), fresh()]
        times: list[list[float]] = [[], []]
        same = True
        for step in range(steps + 2):
            if joins:  # the prompt joins anew each step
                batches = [fresh(), fresh()]
            feeds = [[5 + step]] * count + ([prompt] if joins else [])
            logits = []
            for own, batch in enumerate(batches):
                began = time.perf_counter()
                with mock.patch.object(direct, "serves", lambda _: False) if own else nullcontext():
                    logits.append(batch.step_packed(lm.model, feeds))
                if step >= 2:
                    times[own].append((time.perf_counter() - began) * 1000)
            same = same and torch.equal(*logits)
        name = f"{count} rows + a 31-token prompt" if joins else f"{count} row{'s' if count > 1 else ''}"
        found.append((name, statistics.median(times[0]), statistics.median(times[1]), same))
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rows", default="1,8,16")
    parser.add_argument("--padded", action="store_true", help="the padded step (layouts a packed step does not take)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    lm = load_model("smollm2", "cpu", "float32")
    counts = [int(c) for c in args.rows.split(",")]
    results = {count: profile_rows(lm, count, args.steps, args.padded) for count in counts}
    join = joining(lm, 8)
    against = written_out_against_own(lm, counts, args.steps) if not args.padded and direct.serves(lm.model) else []
    kinds = [k for k in results[counts[0]] if k not in ("tokens/s",)]
    lines = [
        "# One decode step of ragkv's own engine, profiled",
        "",
        f"Generated by `python benchmarks/decode_profile.py --steps {args.steps} --rows {args.rows}"
        f"{' --padded' if args.padded else ''}` on {describe()}.",
        f"SmolLM2-135M, float32, rows of ~{CONTEXT}-token contexts in the continuous batch (`RaggedBatch`), one token "
        f"per row per step, {'padded steps' if args.padded else 'packed steps (`step_packed`, as the runner takes them)'}"
        "; medians over the steps after three warm-up ones. The kinds come from torch's profiler "
        "(each op's own time): *attention* (sdpa and its parts), *mask* (building the padding and causal mask), "
        "*linear* (the projections and MLP matmuls), *cache writes* (each row's new keys and values put in its slot), "
        "*other ops* (norms, rotary, activations, adds, ...), *python between ops* (the forward's wall time no op "
        "accounts for: module calls, argument handling), and *pick* (each row's `Decoder` and text stream, outside "
        "the forward). *step (wall)* is measured without the profiler.",
        "",
        "| ms per step | " + " | ".join(f"{c} row{'s' if c > 1 else ''}" for c in counts) + " |",
        "|---|" + "---|" * len(counts),
    ]
    for kind in kinds:
        lines.append(f"| {kind} | " + " | ".join(f"{results[c][kind]:.1f}" for c in counts) + " |")
    lines.append("| decode tokens/s | " + " | ".join(f"{results[c]['tokens/s']:.1f}" for c in counts) + " |")
    added = join["decode step with the prompt packed in"] - join["decode step"]
    apart = join["the prompt's own prefill"]
    lines += [
        "",
        f"A prompt joining 8 decoding rows (31 tokens over its own ~{CONTEXT}-token context), ms (medians of 7):",
        "",
        "| | ms |",
        "|---|---|",
        *(f"| {kind} | {ms:.1f} |" for kind, ms in join.items()),
        "",
        f"Packed, the prompt adds {added:.1f} ms to the step; apart, its prefill took {apart:.1f} ms beside it.",
        "",
    ]
    if against:
        lines += [
            "The packed step written out (`ragkv.kv.direct`, the Llama kind's layers without transformers' wrapping) "
            "against the model's own forward, stepped alternately on two batches of the same rows "
            f"(medians of {args.steps} steps each):",
            "",
            "| rows | written out, ms | model's own, ms | own / written out | logits bitwise equal |",
            "|---|---|---|---|---|",
            *(
                f"| {name} | {ours:.1f} | {own:.1f} | {own / ours:.2f}x | {'yes' if same else 'NO'} |"
                for name, ours, own, same in against
            ),
            "",
        ]
    OUT.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
