"""`ragkv eval`: measure a store's retrieval settings on its owner's questions (ragkv.retrieval.evaluate)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from ragkv.cli.app import quiet_libraries
from ragkv.cli.commands import app, echo_lines
from ragkv.cli.options import DeviceOption, JsonOption, ModelOverrideOption, StoreOption
from ragkv.core.config import DEFAULT_RETRIEVAL

STAGES = ("embed", "dense", "lexical", "fuse", "catalog", "rerank", "cross_encoder", "total")  # in the order they run


@app.command("eval")
def evaluate(
    questions: Path = typer.Argument(
        ...,
        help='JSON lines, one question each, with what answers it: {"question": ..., "doc_ids": [...]} (or '
        '"chunk_ids", or "spans": texts the answer is in), and optionally "answer" (a reference answer).',
    ),
    settings: list[str] | None = typer.Argument(
        None, help="Retrieval settings to compare, each quoted: 'dense' 'hybrid' 'hybrid --rerank 10' ..."
    ),
    store: str = StoreOption,
    compare: list[str] | None = typer.Option(None, "--compare", help="A setting to compare (repeat), as above."),
    answers: bool = typer.Option(
        False, "--answers", help="Also answer each question that has a reference answer: exact match and token F1."
    ),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", help="--answers: tokens per answer."),
    plot: Path | None = typer.Option(
        None, "--plot", help="Write a PNG of each setting's recall@k, MRR@10 and nDCG@10 with intervals."
    ),
    model: str | None = ModelOverrideOption,
    device: str = DeviceOption,
    json_out: bool = JsonOption,
):
    """Measure retrieval on your own questions: recall@1/5/10, MRR@10 and nDCG@10 with 95%
    bootstrap intervals, and p50/p90 latency per stage, for each setting side by side in one
    run (default: the default retrieval). The way to choose a store's settings."""
    quiet_libraries()
    import ragkv
    from ragkv.retrieval.evaluate import Setting, read_items
    from ragkv.retrieval.evaluate import evaluate as run

    items = read_items(questions)
    chosen = [Setting.parse(text) for text in [*(settings or []), *(compare or [])] or [DEFAULT_RETRIEVAL]]
    with ragkv.open(store, model=model, device=device, write_back=False) as engine:
        measured = run(engine, items, chosen, answers, max_new_tokens)
    report = {"questions": len(items), "store": store, "settings": [m.to_dict() for m in measured]}
    if plot is not None:
        plot_report(report, plot)
    echo_lines([json.dumps(report)] if json_out else report_lines(report))


def report_lines(report: dict) -> list[str]:
    """The report as two tables: the metrics with their intervals, then latency per stage."""
    settings = report["settings"]
    names = [n for n in settings[0]["metrics"]] if settings else []
    width = max([len(s["setting"]) for s in settings] + [7])
    lines = [f"{report['questions']} questions; mean [95% interval]"]
    lines.append(f"{'setting':<{width}}  " + "  ".join(f"{n:<19}" for n in names))
    for s in settings:
        cells = [f"{m['mean']:.3f} [{m['low']:.3f},{m['high']:.3f}]" for m in s["metrics"].values()]
        errors = f"  ({s['errors']} errors)" if s["errors"] else ""
        lines.append(f"{s['setting']:<{width}}  " + "  ".join(f"{c:<19}" for c in cells) + errors)
    seen = {stage for s in settings for stage in s["latency_ms"]}
    stages = [stage for stage in STAGES if stage in seen] + sorted(seen - set(STAGES))
    lines += ["", "latency ms, p50 / p90", f"{'setting':<{width}}  " + "  ".join(f"{n:<15}" for n in stages)]
    for s in settings:
        cells = [
            f"{s['latency_ms'][n]['p50']:.1f} / {s['latency_ms'][n]['p90']:.1f}" if n in s["latency_ms"] else "-"
            for n in stages
        ]
        lines.append(f"{s['setting']:<{width}}  " + "  ".join(f"{c:<15}" for c in cells))
    return [line.rstrip() for line in lines]


def plot_report(report: dict, path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        from ragkv.core.errors import MissingExtraError

        raise MissingExtraError("ragkv eval --plot", "bench", "matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = report["settings"]
    names = [n for n in settings[0]["metrics"] if n not in ("exact_match", "f1")]
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(names) * len(settings) / 2), 4))
    width = 0.8 / len(settings)
    for i, s in enumerate(settings):
        means = [s["metrics"][n]["mean"] for n in names]
        errors = [
            [m - s["metrics"][n]["low"] for n, m in zip(names, means, strict=True)],
            [s["metrics"][n]["high"] - m for n, m in zip(names, means, strict=True)],
        ]
        ax.bar([j + i * width for j in range(len(names))], means, width, yerr=errors, capsize=3, label=s["setting"])
    ax.set_xticks([j + width * (len(settings) - 1) / 2 for j in range(len(names))], names)
    ax.set_ylim(0, 1)
    ax.set_title(f"{report['questions']} questions, 95% bootstrap intervals")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
