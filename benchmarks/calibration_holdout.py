"""Does `ragkv calibrate`'s choice hold out? Held-in questions (drawn from the store's own
chunks) choose what `--mode approximate` runs as; held-out questions (the corpus's own FAQ,
never seen by the calibration) say whether the choice keeps its word.

For each corpus (the Python FAQ from Debian's python3.11-doc, and the sample corpus's FAQ
lines), the store is calibrated with `ragkv calibrate`'s defaults (32 questions in three
shapes, top-5, a configuration chosen when the lower end of its first-token agreement's
one-sided 90% interval reaches 90%). Then every held-out question is asked at top-5: its
first token under each configuration against a full prefill's, cold (RAM tier and prefix
cache emptied). Reported side by side:
- the configuration the calibration chose, held in (mean and lower bound) and held out;
- the one the earlier rule would have chosen from the same measurements (the fastest whose
  held-in mean reached 90%), held out;
- the uncalibrated default (`query` 20%), held out.

    python benchmarks/calibration_holdout.py [--work DIR] [--questions 45]

Writes benchmarks/results/calibration_holdout.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import ragkv  # noqa: E402
from benchmarks.approximate import bootstrap, python_faq_with_gold, sample_faq  # noqa: E402
from benchmarks.fidelity import work_dir  # noqa: E402
from benchmarks.machine import describe  # noqa: E402
from ragkv.core.config import APPROXIMATE, DEFAULT_BLEND_RATIOS, AskSettings, IngestSettings, ModelSettings  # noqa: E402
from ragkv.modes.calibration import Calibration, Measured, choose  # noqa: E402
from ragkv.pipelines.calibrate import PLAIN, CalibrateSettings, calibrate, cold, teacher_forced  # noqa: E402
from ragkv.pipelines.progress import default_reporter  # noqa: E402

TOP_K = 5


def mean_rule(calibration: Calibration) -> Measured | None:
    """What the rule before would have chosen from the same measurements: the fastest whose
    held-in mean reached the target and beat exact's TTFT (each read without its bound)."""
    means = [dataclasses.replace(m, first_token_low=None) for m in calibration.measured]
    return choose(means, calibration.target, calibration.exact_ttft_ratio)


def held_out(engine, questions: list[str], configs: dict[str, AskSettings]) -> dict[str, dict]:
    """Per configuration: its first token's agreement with a full prefill's over `questions`
    (mean and 95% bootstrap interval), and its median cold TTFT over the full prefill's."""
    agree: dict[str, list[float]] = {name: [] for name in configs}
    seconds: dict[str, list[float]] = {name: [] for name in configs}
    full_s = []
    for question in questions:
        cold(engine)
        reference = teacher_forced(engine, question, AskSettings(top_k=TOP_K, use_cache=False), [0])
        first = int(reference.first_logits.argmax())
        full_s.append(reference.seconds)
        for name, settings in configs.items():
            cold(engine)
            got = teacher_forced(engine, question, settings, [first])
            agree[name].append(float(int(got.first_logits.argmax()) == first))
            seconds[name].append(got.seconds)
    full = statistics.median(full_s)
    return {
        name: {"first": bootstrap(agree[name]), "ttft": statistics.median(seconds[name]) / full} for name in configs
    }


def settings_of(measured: Measured | None) -> AskSettings:
    if measured is None:  # gated: approximate answers exactly
        return AskSettings.from_dict({"top_k": TOP_K, "mode": "exact", **PLAIN})
    return AskSettings.from_dict({"top_k": TOP_K, "mode": measured.mode, "blend_ratio": measured.share, **PLAIN})


def label(measured: Measured | None) -> str:
    return "exact (gated)" if measured is None else f"{measured.mode} {measured.share:.0%}"


def run_corpus(name: str, docs: Path, questions: list[str], work: Path) -> dict:
    store = work / ("holdout-" + re.sub(r"\W+", "-", name))
    started = time.perf_counter()
    ragkv.ingest(
        [docs], store, model=ModelSettings(device="cpu", dtype="float32"), settings=IngestSettings(chunk_tokens=256)
    )
    calibration = calibrate(store, CalibrateSettings(top_k=TOP_K), default_reporter(True), device="cpu")
    calibrate_s = time.perf_counter() - started
    chosen, before = calibration.chosen, mean_rule(calibration)
    share = DEFAULT_BLEND_RATIOS[APPROXIMATE]
    default = AskSettings.from_dict({"top_k": TOP_K, "mode": APPROXIMATE, "blend_ratio": share, **PLAIN})
    configs = {"chosen": settings_of(chosen), "mean rule": settings_of(before), "default": default}
    with ragkv.open(store, device="cpu", write_back=False) as engine:
        engine.ask(questions[0], max_new_tokens=1)  # warm up
        out = held_out(engine, questions, configs)
    print(f"{name}: done", file=sys.stderr, flush=True)
    return {
        "calibration": calibration,
        "chosen": chosen,
        "before": before,
        "held_out": out,
        "questions": len(questions),
        "seconds": calibrate_s,
    }


def render(results: dict, args, elapsed: float) -> str:
    lines = [
        "# Does the calibration's choice hold out?",
        "",
        f"Machine: {describe()}. Bundled SmolLM2-135M-Instruct, float32, top-{TOP_K}.",
        f"Command: `python benchmarks/calibration_holdout.py {' '.join(sys.argv[1:])}` ({elapsed / 60:.0f} min).",
        "Held in: `ragkv calibrate`'s defaults (32 questions drawn from the store's own chunks in three shapes: "
        '"What does the text say about <first sentence>?", "Is it true that <a later sentence>?", and the chunk\'s '
        "rarest words as a search query). Held out: the corpus's own FAQ questions. First token against a full "
        "prefill's, cold; intervals: 95% bootstrap over the held-out questions.",
        "",
        "| corpus | rule | chose | held in: first token (at least, 90%) | held out: first token | gap, points | "
        "held-out TTFT vs full |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        for rule, key, measured in (
            ("lower bound (now)", "chosen", r["chosen"]),
            ("mean (before)", "mean rule", r["before"]),
        ):
            first, ttft = r["held_out"][key]["first"], r["held_out"][key]["ttft"]
            held_in = 1.0 if measured is None else measured.first_token
            low = 1.0 if measured is None else measured.assured
            lines.append(
                f"| {name} | {rule} | {label(measured)} | {held_in:.0%} ({low:.0%}) | "
                f"{first[0]:.0%} [{first[1]:.0%}, {first[2]:.0%}] | {100 * (first[0] - held_in):+.0f} | {ttft:.2f} |"
            )
        first, ttft = r["held_out"]["default"]["first"], r["held_out"]["default"]["ttft"]
        share = DEFAULT_BLEND_RATIOS[APPROXIMATE]
        lines.append(
            f"| {name} | uncalibrated default | {APPROXIMATE} {share:.0%} | - | "
            f"{first[0]:.0%} [{first[1]:.0%}, {first[2]:.0%}] | - | {ttft:.2f} |"
        )
    lines.append("")
    for name, r in results.items():
        c: Calibration = r["calibration"]
        lines.append(
            f"{name}: {r['questions']} held-out questions; ingest and calibration {r['seconds']:.0f} s; "
            f"the sweep (held in, mean / at least): "
            + ", ".join(f"{m.mode} {m.share:.0%} {m.first_token:.0%}/{m.assured:.0%}" for m in c.measured)
            + f"; exact TTFT {c.exact_ttft_ratio:.2f}."
        )
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=45, help="Python FAQ questions held out")
    parser.add_argument("--work", type=Path, default=None, help="reuse downloads and stores across runs")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "calibration_holdout.md")
    args = parser.parse_args()
    started = time.perf_counter()
    work = work_dir(args.work, "calibration-holdout")
    results = {}
    faq = python_faq_with_gold(work, args.questions)
    if faq:
        docs, pairs = faq
        results["Python FAQ"] = run_corpus("pyfaq", docs, [q for q, _ in pairs], work)
    results["sample corpus"] = run_corpus("sample", ROOT / "data", [q for q, _ in sample_faq()], work)
    args.out.write_text(render(results, args, time.perf_counter() - started))
    print(args.out.read_text())


if __name__ == "__main__":
    main()
