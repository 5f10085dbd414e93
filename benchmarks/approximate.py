"""Does `--mode approximate` earn its name? Every approximate mode against a full prefill of the
same prompt, on a QA set large enough to trust, with each number's spread.

QA set: the Python FAQ from Debian's python3.11-doc (fetched at run time, never committed: each
question heading with the text under it as its gold answer) and the sample corpus's FAQ lines
(data/faq.jsonl: "question? answer"). Both are ingested with the bundled SmolLM2 (float32);
each store is first calibrated (`ragkv calibrate`, on questions drawn from its own chunks: held
in), then every set question (held out) is asked at K = 3, 5 and 10 retrieved chunks, in each
mode: exact, concat, epic 5%, blend 15%, query 20% (question-aware, after ProphetKV) and
`approximate` (what the calibration chose). Per (K, mode), against the full prefill:
- first-token agreement: the mode's top first token is the full prefill's;
- teacher-forced agreement: the full prefill's greedy answer fed after the mode's cache, the
  share of positions whose top token is the full prefill's;
- first-token KL(full || mode);
- answer F1 against the gold answer (SQuAD-style), its paired gap to the full prefill's F1, and
  F1 against the full prefill's own answer;
- time to first token over the full prefill's, cold (RAM tier and prefix cache emptied: what a
  fresh process sees, model loaded) and warm (the same prompt's cache again, right after).
Spreads: 95% bootstrap intervals over questions (2000 resamples). Greedy decoding without
repetition controls, so the full prefill's answer is its argmax path.

    python benchmarks/approximate.py [--questions 45] [--tokens 24] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import ragkv  # noqa: E402
from benchmarks.fidelity import python_faq, work_dir  # noqa: E402
from benchmarks.machine import describe  # noqa: E402
from benchmarks.passages import f1, gold_answers, kl  # noqa: E402
from ragkv.core.config import AskSettings, IngestSettings, ModelSettings  # noqa: E402
from ragkv.modes.calibration import Calibration  # noqa: E402
from ragkv.pipelines.calibrate import PLAIN, CalibrateSettings, calibrate, cold, teacher_forced  # noqa: E402
from ragkv.pipelines.progress import default_reporter  # noqa: E402

KS = (3, 5, 10)
CONFIGS = (("exact", None), ("concat", None), ("epic", 0.05), ("blend", 0.15), ("query", 0.2), ("approximate", None))


def sample_faq() -> list[tuple[str, str]]:
    """(question, gold) from data/faq.jsonl: each line's text is the question, then its answer."""
    pairs = []
    for line in (ROOT / "data" / "faq.jsonl").read_text().splitlines():
        text = json.loads(line)["text"]
        question, _, answer = text.partition("?")
        if answer.strip():
            pairs.append((question.strip() + "?", answer.strip()))
    return pairs


def python_faq_with_gold(work: Path, count: int) -> tuple[Path, list[tuple[str, str]]] | None:
    """The Python FAQ pages and up to `count` (question, gold answer) pairs whose answer has at
    least 10 words, or None if the FAQ cannot be fetched here."""
    faq = python_faq(work, count * 4)
    if faq is None:
        return None
    docs, candidates = faq
    gold = gold_answers(work)
    return docs, [(q, gold[q]) for q in candidates if len(gold.get(q, "").split()) >= 10][:count]


def bootstrap(values: list[float], resamples: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """(mean, low, high): the mean and its 95% bootstrap interval."""
    if not values:
        return 0.0, 0.0, 0.0
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(values, k=len(values))) for _ in range(resamples))
    return statistics.fmean(values), means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]


def settings_for(mode: str, share: float | None, k: int, tokens: int) -> AskSettings:
    options = {"top_k": k, "mode": mode, "max_new_tokens": tokens, **PLAIN}
    if share is not None:
        options["blend_ratio"] = share
    return AskSettings.from_dict(options)


def measure(engine, question: str, gold: str, k: int, tokens: int) -> dict:
    """Every configuration's numbers for one question at K = `k`: each asked cold (its answer
    and cold TTFT), then teacher-forced right after (warm TTFT)."""
    cold(engine)
    full = engine.ask(question, top_k=k, max_new_tokens=tokens, use_cache=False, **PLAIN)
    if not full.token_ids:
        return {}
    reference = teacher_forced(engine, question, AskSettings(top_k=k, use_cache=False), full.token_ids)
    full_first = reference.first_logits
    out = {"full": {"f1": f1(full.text, gold), "ttft": full.stats.ttft_s, "warm": reference.seconds}}
    for mode, share in CONFIGS:
        settings = settings_for(mode, share, k, tokens)
        cold(engine)
        answer = engine.ask(question, settings)
        forced = teacher_forced(engine, question, settings, full.token_ids)
        first, warm = forced.first_logits, forced.seconds
        out[mode] = {
            "first": float(first.argmax() == full_first.argmax()),
            "forced": forced.agreement,
            "kl": kl(full_first, first),
            "f1": f1(answer.text, gold),
            "f1_full": f1(answer.text, full.text),
            "ttft": answer.stats.ttft_s,
            "warm": warm,
            "ran_as": answer.stats.approximation or mode,
        }
    return out


def summarise(per_question: list[dict], k: int) -> list[dict]:
    rows = []
    full_ttft = statistics.median(q["full"]["ttft"] for q in per_question)
    full_warm = statistics.median(q["full"]["warm"] for q in per_question)
    for mode, share in CONFIGS:
        got = [q[mode] for q in per_question]
        rows.append(
            {
                "k": k,
                "mode": mode,
                "share": share,
                "n": len(got),
                "first": bootstrap([g["first"] for g in got]),
                "forced": bootstrap([g["forced"] for g in got]),
                "kl": statistics.fmean(g["kl"] for g in got),
                "f1": bootstrap([g["f1"] for g in got]),
                "f1_gap": bootstrap([g["f1"] - q["full"]["f1"] for g, q in zip(got, per_question, strict=False)]),
                "f1_full": statistics.fmean(g["f1_full"] for g in got),
                "ttft": statistics.median(g["ttft"] for g in got) / full_ttft,
                "warm": statistics.median(g["warm"] for g in got) / full_warm,
                "ran_as": sorted({g["ran_as"] for g in got}),
            }
        )
    return rows


def run_corpus(
    name: str, docs: Path, pairs: list[tuple[str, str]], work: Path, tokens: int
) -> tuple[list, Calibration]:
    store = work / ("store-" + re.sub(r"\W+", "-", name))
    ragkv.ingest(
        [docs], store, model=ModelSettings(device="cpu", dtype="float32"), settings=IngestSettings(chunk_tokens=256)
    )
    calibration = calibrate(store, CalibrateSettings(questions=8, top_k=5), default_reporter(True), device="cpu")
    rows = []
    with ragkv.open(store, device="cpu", write_back=False) as engine:
        engine.ask(pairs[0][0], max_new_tokens=1)  # warm up
        for k in KS:
            per_question = [m for q, g in pairs if (m := measure(engine, q, g, k, tokens))]
            rows += summarise(per_question, k)
            print(f"{name}: K={k} done", file=sys.stderr, flush=True)
    return rows, calibration


def interval(stat: tuple[float, float, float], percent: bool = True) -> str:
    mean, low, high = stat
    return f"{mean:.0%} [{low:.0%}, {high:.0%}]" if percent else f"{mean:+.3f} [{low:+.3f}, {high:+.3f}]"


def render(results: dict, args, elapsed: float) -> str:
    lines = [
        "# `--mode approximate` and every approximate mode against a full prefill",
        "",
        f"Bundled SmolLM2-135M-Instruct, float32, CPU ({describe()}). {args.tokens} new tokens, greedy without "
        "repetition controls. Each store calibrated first (`ragkv calibrate --top-k 5 --questions 8`: questions "
        "drawn from its own chunks, held in); the set's questions are held out. Intervals: 95% bootstrap over questions. TTFT: "
        "median over the full prefill's, cold (RAM tier and prefix cache emptied) and warm (the same prompt's cache "
        "again, right after). "
        f"Command: `python benchmarks/approximate.py --questions {args.questions} --tokens {args.tokens}` "
        f"({elapsed / 60:.0f} min).",
        "",
    ]
    for name, (rows, calibration) in results.items():
        lines += [
            f"## {name}: {rows[0]['n']} questions; calibration: {calibration.describe()}",
            "",
            "| K | mode | first token = full | teacher-forced | first-token KL | F1 gold | F1 gap to full | "
            "F1 vs full's answer | TTFT cold | TTFT warm |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            label = r["mode"] + (f" {r['share']:.0%}" if r["share"] is not None else "")
            if r["mode"] == "approximate":
                label += " (" + "; ".join(r["ran_as"]).split(",")[0] + ")"
            lines.append(
                f"| {r['k']} | {label} | {interval(r['first'])} | {interval(r['forced'])} | {r['kl']:.2e} | "
                f"{r['f1'][0]:.3f} | {interval(r['f1_gap'], False)} | {r['f1_full']:.2f} | "
                f"{r['ttft']:.2f} | {r['warm']:.2f} |"
            )
        lines += ["", *sweep(calibration), ""]
    return "\n".join(lines)


def sweep(calibration: Calibration) -> list[str]:
    """The calibration's measurements (held-in questions, top-5): each mode's share sweep, stopped
    at the first share that reached the target; the Pareto front of agreement against TTFT."""
    lines = [
        f"Calibration sweep ({calibration.num_questions} held-in questions, top-{calibration.top_k}, target "
        f"{calibration.target:.0%}; exact: TTFT {calibration.exact_ttft_ratio:.2f}):",
        "",
        "| mode | recomputed | first token = full | teacher-forced | TTFT vs full |",
        "|---|---|---|---|---|",
    ]
    for m in calibration.measured:
        lines.append(
            f"| {m.mode} | {m.share:.0%} | {m.first_token:.0%} | {m.teacher_forced:.0%} | {m.ttft_ratio:.2f} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=45, help="Python FAQ questions (the sample FAQ adds its own)")
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--work", type=Path, default=None, help="reuse downloads and stores across runs")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "approximate.md")
    args = parser.parse_args()
    started = time.perf_counter()
    work = work_dir(args.work, "approximate")
    results = {}
    faq = python_faq_with_gold(work, args.questions)
    if faq:
        docs, pairs = faq
        results["Python FAQ (python3.11-doc)"] = run_corpus("pyfaq", docs, pairs, work, args.tokens)
    results["sample corpus (data/faq.jsonl)"] = run_corpus("sample", ROOT / "data", sample_faq(), work, args.tokens)
    args.out.write_text(render(results, args, time.perf_counter() - started))
    print(args.out.read_text())


if __name__ == "__main__":
    main()
