"""Small stores must not get slower: the sample corpus's ingest, a one-document change and
ask times in two source trees side by side in one run: this one and another checkout
(`--before TREE`, e.g. `git worktree add ../before 102d0ec`, the commit before catalog deltas
and vector segments). Each measurement runs in a fresh process that imports its tree's ragkv;
the trees alternate, `--repeats` times each.

Per run, on the bundled SmolLM2 in float32 over `data/`: a fresh ingest; an ingest of the
same folder with one document changed; then an engine answers QUESTIONS (one warm-up first),
8 new tokens each, and the median seconds per answer and the median time to first token
are kept. Answers are compared token for token across the trees.

    python benchmarks/small_store.py --before ../before [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.machine import describe  # noqa: E402

QUESTIONS = [
    "How do I rotate the API key?",
    "How many days of annual leave do I get?",
    "How do we deploy to production?",
    "How long are backups kept?",
    "How much is an on-call week paid?",
    "Who approves my leave?",
    "Can I deploy on Friday?",
    "Where are write-ahead logs archived?",
    "What if the API key leaked?",
    "What goes in the on-call handover?",
]

WORKER = r"""
import json, shutil, sys, time
from pathlib import Path
tree, docs, work, questions = sys.argv[1:5]
sys.path.insert(0, tree)
import ragkv
from ragkv.core.config import AskSettings
work = Path(work)
store = work / "store"
start = time.perf_counter()
ragkv.ingest(docs, store)
ingest_s = time.perf_counter() - start
changed = work / "docs"
shutil.copytree(docs, changed)
target = sorted(p for p in changed.iterdir() if p.suffix == ".md")[0]
target.write_text(target.read_text() + "\n\nOne more line, changed for the benchmark.\n")
start = time.perf_counter()
ragkv.ingest(changed, store)
change_s = time.perf_counter() - start
times, ttfts, answers = [], [], []
with ragkv.open(store, device="cpu") as engine:
    engine.ask(json.loads(questions)[0], max_new_tokens=2)  # warm up
    for q in json.loads(questions):
        start = time.perf_counter()
        answer = engine.ask(q, max_new_tokens=8)
        times.append(time.perf_counter() - start)
        ttfts.append(answer.stats.ttft_s)
        answers.append(answer.text)
print(json.dumps({"ingest_s": ingest_s, "change_s": change_s, "ask_s": sorted(times)[len(times) // 2],
                  "ttft_s": sorted(ttfts)[len(ttfts) // 2], "answers": answers}))
"""


def run(tree: Path) -> dict:
    with tempfile.TemporaryDirectory() as work:
        out = subprocess.run(
            [sys.executable, "-c", WORKER, str(tree), str(ROOT / "data"), work, json.dumps(QUESTIONS)],
            capture_output=True,
            text=True,
        )
        if out.returncode:
            raise SystemExit(f"{tree}: {out.stderr.strip().splitlines()[-1]}")
        return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True)
    parser.add_argument("--after", type=Path, default=ROOT)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "small_store.md")
    args = parser.parse_args()
    runs = {"before": [], "after": []}
    for _ in range(args.repeats):
        for name, tree in (("before", args.before), ("after", args.after)):
            runs[name].append(run(tree.resolve()))
            print(name, json.dumps({k: v for k, v in runs[name][-1].items() if k != "answers"}), flush=True)
    median = {
        name: {k: statistics.median(r[k] for r in rs) for k in ("ingest_s", "change_s", "ask_s", "ttft_s")}
        for name, rs in runs.items()
    }
    same = all(r["answers"] == runs["before"][0]["answers"] for rs in runs.values() for r in rs)
    lines = [
        "# Small stores: before and after deltas and segments",
        "",
        f"Machine: {describe()}",
        "",
        f"Command: `python benchmarks/small_store.py --before {args.before} --repeats {args.repeats}`",
        "",
        "Sample corpus (`data/`), bundled SmolLM2 in float32; medians of the runs, trees alternating.",
        "",
        "| | before | after | after / before |",
        "|---|---|---|---|",
    ]
    for key, label in (
        ("ingest_s", "fresh ingest (s)"),
        ("change_s", "ingest with one document changed (s)"),
        ("ask_s", "one answer, 8 tokens (s)"),
        ("ttft_s", "time to first token (s)"),
    ):
        b, a = median["before"][key], median["after"][key]
        lines.append(f"| {label} | {b:.3f} | {a:.3f} | {a / b:.2f} |")
    lines += [
        "",
        f"Answers token-identical across trees and runs: {'yes' if same else 'NO'}.",
        "",
        "Every run: "
        + "; ".join(
            f"{name}: "
            + ", ".join(f"ingest {r['ingest_s']:.2f}s change {r['change_s']:.2f}s ask {r['ask_s']:.3f}s" for r in rs)
            for name, rs in runs.items()
        ),
    ]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
