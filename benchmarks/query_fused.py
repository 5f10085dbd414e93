"""`--mode query` with its recompute in the question's prefill (one forward), against the same
mode recomputing first and prefilling after (two forwards: what it ran before), and against a
full prefill, on the held-out sets of benchmarks/approximate.py.

Both query variants choose the same tokens (the question's attention probe over the
concatenated cache); they differ only in whether the chosen tokens and the question share a
forward. Per K = 3, 5, 10 and question (held out: no calibration runs here), each asked cold
(RAM tier and prefix cache emptied): time to first token over the full prefill's (median),
first-token agreement with the full prefill, teacher-forced agreement (the full prefill's
greedy answer fed after the mode's cache) and whether the two variants' first tokens agree.

    python benchmarks/query_fused.py [--questions 45] [--tokens 24] [--work DIR]

Writes benchmarks/results/query_fused.md.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import ragkv  # noqa: E402
from benchmarks.approximate import bootstrap, interval, python_faq_with_gold, sample_faq  # noqa: E402
from benchmarks.fidelity import work_dir  # noqa: E402
from benchmarks.machine import describe  # noqa: E402
from ragkv.core.config import AskSettings, IngestSettings, ModelSettings  # noqa: E402
from ragkv.model.generate import prefill  # noqa: E402
from ragkv.modes.blend import Recompute, _recompute  # noqa: E402
from ragkv.pipelines.calibrate import PLAIN, cold, teacher_forced  # noqa: E402

KS = (3, 5, 10)
CONFIGS = (
    ("one forward", 0.2),
    ("two forwards", 0.2),
    ("one forward", 0.1),
    ("one forward", 0.3),
    ("one forward", 0.5),
)


@contextmanager
def two_forwards():
    """Query mode as it ran before: the chosen tokens' own forward, then the question's."""
    fused = Recompute.prefill

    def separate(self, model, input_ids, cache):
        ids = torch.zeros(1, self.num_context, dtype=torch.long, device=model.device)
        ids[0, self.positions] = self.ids
        with torch.inference_mode():
            _recompute(model, cache, ids, self.positions)
        return prefill(model, input_ids, cache)

    Recompute.prefill = separate  # type: ignore[method-assign]
    try:
        yield
    finally:
        Recompute.prefill = fused  # type: ignore[method-assign]


def measure(engine, question: str, k: int, tokens: int) -> dict | None:
    cold(engine)
    full = engine.ask(question, top_k=k, max_new_tokens=tokens, use_cache=False, **PLAIN)
    if not full.token_ids:
        return None
    reference = teacher_forced(engine, question, AskSettings(top_k=k, use_cache=False), full.token_ids)
    out: dict = {"full": full.stats.ttft_s}
    for variant, share in CONFIGS:
        settings = AskSettings.from_dict(
            {"top_k": k, "mode": "query", "blend_ratio": share, "max_new_tokens": tokens, **PLAIN}
        )
        with two_forwards() if variant == "two forwards" else nullcontext():
            cold(engine)
            answer = engine.ask(question, settings)
            forced = teacher_forced(engine, question, settings, full.token_ids)
        out[(variant, share)] = {
            "ttft": answer.stats.ttft_s,
            "first": float(forced.first_logits.argmax() == reference.first_logits.argmax()),
            "forced": forced.agreement,
            "top": int(forced.first_logits.argmax()),
        }
    return out


def run_corpus(name: str, docs: Path, questions: list[str], work: Path, tokens: int) -> list[dict]:
    store = work / ("store-" + re.sub(r"\W+", "-", name))
    ragkv.ingest(
        [docs], store, model=ModelSettings(device="cpu", dtype="float32"), settings=IngestSettings(chunk_tokens=256)
    )
    rows = []
    with ragkv.open(store, device="cpu", write_back=False) as engine:
        engine.ask(questions[0], max_new_tokens=1)  # warm up
        for k in KS:
            measured = [m for q in questions if (m := measure(engine, q, k, tokens))]
            full = statistics.median(m["full"] for m in measured)
            one, two = ("one forward", 0.2), ("two forwards", 0.2)
            for config in CONFIGS:
                got = [m[config] for m in measured]
                rows.append(
                    {
                        "k": k,
                        "config": config,
                        "n": len(got),
                        "ttft": statistics.median(g["ttft"] for g in got) / full,
                        "first": bootstrap([g["first"] for g in got]),
                        "forced": bootstrap([g["forced"] for g in got]),
                        "same_top": statistics.fmean(m[one]["top"] == m[two]["top"] for m in measured),
                        "speedup": statistics.median(m[two]["ttft"] / m[one]["ttft"] for m in measured),
                        "full_s": full,
                    }
                )
            print(f"{name}: K={k} done", file=sys.stderr, flush=True)
    return rows


def render(results: dict[str, list[dict]], args, elapsed: float) -> str:
    lines = [
        "# `--mode query`: the recompute in the question's prefill (one forward) against two forwards",
        "",
        f"Bundled SmolLM2-135M-Instruct, float32, CPU ({describe()}). Held-out questions (no calibration), "
        f"{args.tokens} new tokens, greedy without repetition controls; every ask cold (RAM tier and prefix cache "
        "emptied). TTFT: median over the full prefill's, measured in the same run on the same prompts. Intervals: 95% "
        f"bootstrap over questions. Command: `python benchmarks/query_fused.py --questions {args.questions} "
        f"--tokens {args.tokens}` ({elapsed / 60:.0f} min).",
        "",
    ]
    for name, rows in results.items():
        lines += [
            f"## {name}: {rows[0]['n']} questions",
            "",
            "| K | query | recomputed | TTFT vs full prefill | first token = full | teacher-forced |",
            "|---|---|---|---|---|---|",
        ]
        for r in rows:
            variant, share = r["config"]
            lines.append(
                f"| {r['k']} | {variant} | {share:.0%} | {r['ttft']:.2f} | {interval(r['first'])} | "
                f"{interval(r['forced'])} |"
            )
        lines += [
            "",
            "| K | full prefill TTFT (s) | two forwards / one forward, TTFT (median per question) | "
            "same first token, one vs two forwards |",
            "|---|---|---|---|",
        ]
        for r in rows:
            if r["config"] == CONFIGS[0]:
                lines.append(f"| {r['k']} | {r['full_s']:.3f} | {r['speedup']:.2f}x | {r['same_top']:.0%} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=45, help="Python FAQ questions (the sample FAQ adds its own)")
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--work", type=Path, default=None, help="reuse downloads and stores across runs")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "query_fused.md")
    args = parser.parse_args()
    started = time.perf_counter()
    work = work_dir(args.work, "query-fused")
    results = {}
    faq = python_faq_with_gold(work, args.questions)
    if faq:
        docs, pairs = faq
        results["Python FAQ (python3.11-doc)"] = run_corpus("pyfaq", docs, [q for q, _ in pairs], work, args.tokens)
    sample = [q for q, _ in sample_faq()]
    results["sample corpus (data/faq.jsonl)"] = run_corpus("sample", ROOT / "data", sample, work, args.tokens)
    args.out.write_text(render(results, args, time.perf_counter() - started))
    print(args.out.read_text())


if __name__ == "__main__":
    main()
