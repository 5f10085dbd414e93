"""Several passages per question: what each multi-passage mode keeps of a full prefill's answer,
and what it costs, swept over the share of context tokens recomputed.

QA set: the Python FAQ from Debian's python3.11-doc package (fetched at run time, never
committed): each question heading is a question, the text under it its gold answer. The pages
are ingested with the bundled SmolLM2 (float32, 256-token chunks); each question retrieves K
passages. Per K (1, 3, 5, 10) and per mode (`exact`; `concat`; `blend` and `epic` at 5, 15, 30
and 100% recomputed), against a full prefill of the very same prompt:
- teacher-forced top-1 agreement: the full prefill's greedy answer (N tokens) is fed after the
  mode's cache; the share of positions where the mode's own top token is the full prefill's;
- first-token KL(full || mode);
- answer F1 against the gold answer (SQuAD-style word overlap), and its gap to the full prefill's;
- time to first token over the full prefill's (median; prefix cache and RAM tier emptied).
Greedy decoding without repetition controls, so that the full prefill's answer is its argmax path.
Writes benchmarks/results/passages.md and a Pareto plot (TTFT ratio against agreement) .png.

    python benchmarks/passages.py [--questions 8] [--tokens 32] [--work DIR]
"""

from __future__ import annotations

import argparse
import collections
import glob
import re
import statistics
import string
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import ragkv  # noqa: E402
from benchmarks.fidelity import python_faq_or_exit, work_dir  # noqa: E402
from benchmarks.machine import describe  # noqa: E402
from ragkv.core.config import AskSettings, IngestSettings, ModelSettings  # noqa: E402
from ragkv.pipelines import calibrate  # noqa: E402
from ragkv.pipelines.calibrate import PLAIN, cold  # noqa: E402

KS = (1, 3, 5, 10)
RATIOS = (0.05, 0.15, 0.30, 1.0)
RECOMPUTING = ("blend", "epic")  # the modes swept over the share recomputed
APE_POINTS = ((1.0, 0.7),)  # (temperature, scale) measured for ape: the defaults; --ape-grid sweeps more
APE_GRID = tuple((1.0, s) for s in (0.4, 0.5, 0.6, 0.7, 0.8, 0.9))


@dataclass(frozen=True)
class Config:
    mode: str
    ratio: float = 0.0  # share recomputed (RECOMPUTING modes)
    ape: tuple[float, float] | None = None  # (temperature, scale) for ape

    @property
    def options(self) -> dict:
        options = {"mode": self.mode, "blend_ratio": self.ratio}
        if self.ape:
            options.update(ape_temperature=self.ape[0], ape_scale=self.ape[1])
        return options

    @property
    def label(self) -> str:
        if self.ape:
            return f"ape T={self.ape[0]:g} S={self.ape[1]:g}"
        return self.mode if self.mode not in RECOMPUTING else f"{self.mode} {self.ratio:.0%}"


def configurations(
    ratios=RATIOS, modes=("exact", "concat", *RECOMPUTING, "ape"), ape_points=APE_POINTS
) -> list[Config]:
    configs = [Config(m) for m in ("exact", "concat") if m in modes]
    configs += [Config(m, r) for m in RECOMPUTING if m in modes for r in ratios]
    return configs + [Config("ape", ape=point) for point in ape_points if "ape" in modes]


def gold_answers(work: Path) -> dict[str, str]:
    """Question heading -> the text under it, from the FAQ pages `python_faq` extracted."""
    from bs4 import BeautifulSoup

    html = work / "pyfaq" / "usr" / "share" / "doc" / "python3.11" / "html" / "faq"
    answers = {}
    for page in sorted(glob.glob(str(html / "*.html"))):
        soup = BeautifulSoup(Path(page).read_text(encoding="utf-8"), "html.parser")
        for section in soup.select("section"):
            heading = section.find("h3", recursive=False)
            if heading is None:
                continue
            question = re.sub(r"\s+", " ", heading.get_text(" ")).replace("¶", "").strip()
            heading.extract()
            answers[question] = re.sub(r"\s+", " ", section.get_text(" ")).strip()
    return answers


def f1(prediction: str, gold: str) -> float:
    """SQuAD-style: word overlap F1 after lower-casing and dropping punctuation and articles."""

    def words(text: str) -> list[str]:
        text = "".join(c for c in text.lower() if c not in string.punctuation)
        return [w for w in text.split() if w not in ("a", "an", "the")]

    p, g = words(prediction), words(gold)
    common = sum((collections.Counter(p) & collections.Counter(g)).values())
    if not p or not g or not common:
        return 0.0
    precision, recall = common / len(p), common / len(g)
    return 2 * precision * recall / (precision + recall)


def teacher_forced(engine, question: str, settings: AskSettings, answer_ids: list[int]) -> tuple[torch.Tensor, float]:
    """(first-token logits, top-1 agreement) of `settings`' cache, read cold, with `answer_ids`
    fed after it (calibration's teacher forcing)."""
    cold(engine)
    forced = calibrate.teacher_forced(engine, question, settings, answer_ids)
    return forced.first_logits, forced.agreement


def kl(full: torch.Tensor, approx: torch.Tensor) -> float:
    p = full.log_softmax(-1)
    return float((p.exp() * (p - approx.log_softmax(-1))).sum())


def evaluate(engine, questions: list[str], gold: dict[str, str], tokens: int, ks, configs: list[Config]) -> list[dict]:
    rows = []
    engine.ask(questions[0], max_new_tokens=1)  # warm up
    for k in ks:
        per = {c: {"agree": [], "kl": [], "f1": [], "ttft": []} for c in configs}
        full_f1, full_ttft = [], []
        for question in questions:
            cold(engine)
            full = engine.ask(question, top_k=k, max_new_tokens=tokens, use_cache=False, **PLAIN)
            if not full.token_ids:
                continue
            full_ttft.append(full.stats.ttft_s)
            full_f1.append(f1(full.text, gold[question]))
            full_first, _ = teacher_forced(engine, question, AskSettings(top_k=k, use_cache=False), full.token_ids)
            for config in configs:
                settings = AskSettings.from_dict({"top_k": k, **config.options, "max_new_tokens": tokens, **PLAIN})
                cold(engine)
                answer = engine.ask(question, settings)
                first, agreement = teacher_forced(engine, question, settings, full.token_ids)
                stats = per[config]
                stats["agree"].append(agreement)
                stats["kl"].append(kl(full_first, first))
                stats["f1"].append(f1(answer.text, gold[question]))
                stats["ttft"].append(answer.stats.ttft_s)
        for config, stats in per.items():
            if not stats["agree"]:
                continue
            rows.append(
                {
                    "k": k,
                    "mode": config.mode,
                    "ratio": config.ratio,
                    "label": config.label,
                    "n": len(stats["agree"]),
                    "agree": statistics.mean(stats["agree"]),
                    "kl": statistics.mean(stats["kl"]),
                    "f1": statistics.mean(stats["f1"]),
                    "full_f1": statistics.mean(full_f1),
                    "ttft_ratio": statistics.median(stats["ttft"]) / statistics.median(full_ttft),
                    "full_ttft": statistics.median(full_ttft),
                }
            )
        print(f"K={k} done", file=sys.stderr, flush=True)
    return rows


def render(rows: list[dict], chunks: int, args, elapsed: float) -> str:
    lines = [
        "# Several passages per question: agreement, F1 and speed against a full prefill",
        "",
        f"Bundled SmolLM2-135M-Instruct, float32, on {describe()}, {torch.get_num_threads()} threads. QA set: the "
        f"Python FAQ (python3.11-doc, {chunks} chunks of up to 256 tokens), {rows[0]['n'] if rows else 0} questions "
        f"with their gold answers; {args.tokens} new tokens, greedy without repetition controls. Agreement: "
        "teacher-forced top-1 agreement with the full prefill's answer; F1: against the gold answer (the full "
        "prefill's own F1 beside it); TTFT: median over the full prefill's, prefix cache and RAM tier emptied. "
        f"Command: `python benchmarks/passages.py --questions {args.questions} --tokens {args.tokens} --ks {args.ks} "
        f"--ratios {args.ratios} --modes {args.modes}{' --ape-grid' if args.ape_grid else ''}` "
        f"({elapsed / 60:.0f} min).",
        "",
        "| K | mode | recomputed | agreement | first-token KL | F1 | F1 full | F1 gap | TTFT vs full |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        recomputed = f"{r['ratio']:.0%}" if r["mode"] in RECOMPUTING else ("0%" if r["mode"] != "exact" else "-")
        name = r["label"] if r["mode"] == "ape" else r["mode"]
        lines.append(
            f"| {r['k']} | {name} | {recomputed} | {r['agree']:.1%} | {r['kl']:.2e} | {r['f1']:.3f} | "
            f"{r['full_f1']:.3f} | {r['f1'] - r['full_f1']:+.3f} | {r['ttft_ratio']:.2f} "
            f"(full {r['full_ttft']:.2f} s) |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = sorted({r["k"] for r in rows if r["k"] > 1})
    fig, axes = plt.subplots(1, len(ks), figsize=(4 * len(ks), 3.8), sharey=True, squeeze=False)
    axes = axes[0]
    for axis, k in zip(axes, ks, strict=False):
        markers = (
            ("exact", "s"),
            ("concat", "x"),
            ("blend (layer 1)", "o"),
            ("blend", "v"),
            ("epic", "^"),
            ("ape", "D"),
        )
        for mode, marker in markers:
            mine = sorted((r for r in rows if r["k"] == k and r["mode"] == mode), key=lambda r: r["ratio"])
            if mine:
                axis.plot(
                    [r["ttft_ratio"] for r in mine],
                    [r["agree"] for r in mine],
                    marker=marker,
                    linestyle="-" if len(mine) > 1 else "",
                    label=mode,
                )
                for r in mine:
                    if len(mine) > 1:
                        axis.annotate(f"{r['ratio']:.0%}", (r["ttft_ratio"], r["agree"]), fontsize=6)
        axis.set(title=f"K = {k}", xlabel="TTFT / full prefill (lower is faster)")
        axis.axhline(0.9, color="grey", linewidth=0.5, linestyle=":")
    axes[0].set_ylabel("teacher-forced top-1 agreement")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--ks", default=",".join(map(str, KS)), help="passages per question to measure")
    parser.add_argument("--ratios", default=",".join(map(str, RATIOS)), help="shares recomputed by blend and epic")
    parser.add_argument("--modes", default="exact,concat,blend,epic,ape", help="modes to measure")
    parser.add_argument("--ape-grid", action="store_true", help="measure ape over a grid of temperatures and scales")
    parser.add_argument("--work", type=Path, default=None, help="reuse downloads and the store across runs")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "passages.md")
    args = parser.parse_args()
    started = time.perf_counter()
    work = work_dir(args.work, "passages")
    docs, candidates = python_faq_or_exit(work, args.questions * 4)
    gold = gold_answers(work)
    questions = [q for q in candidates if len(gold.get(q, "").split()) >= 10][::4][: args.questions]
    store = work / "store-256"
    ragkv.ingest(
        [docs], store, model=ModelSettings(device="cpu", dtype="float32"), settings=IngestSettings(chunk_tokens=256)
    )
    with ragkv.open(store, device="cpu") as engine:
        chunks = engine.snapshot.catalog.reports.counts()["chunks"]
        configs = configurations(
            [float(r) for r in args.ratios.split(",")], args.modes.split(","), APE_GRID if args.ape_grid else APE_POINTS
        )
        rows = evaluate(engine, questions, gold, args.tokens, [int(k) for k in args.ks.split(",")], configs)
    args.out.write_text(render(rows, chunks, args, time.perf_counter() - started))
    plot(rows, args.out.with_suffix(".png"))
    print(args.out.read_text())


if __name__ == "__main__":
    main()
