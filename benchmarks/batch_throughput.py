"""Questions/s of `ragkv batch` in two source trees side by side in one run: this one and another
checkout (`--before TREE`, e.g. `git worktree add ../before c472a9f`, the commit before
`ragkv batch` moved onto the continuous batcher). Each measurement runs in a fresh process that
imports its tree's ragkv, opens the same store, warms up with one question, then answers the
whole file; the trees alternate, `--repeats` times each. Also: whether both trees' answers are
token-identical, and what each tree's stats say it reused.

Workloads on the bundled SmolLM2 in float32 over the sample corpus: top-1 (short prompts) and
top-5 (long prompts: five chunks, several hundred tokens).

    python benchmarks/batch_throughput.py --before ../before [--after ../after] [--tokens 24] [--repeats 2]
    python benchmarks/batch_throughput.py --before ../before --preset shared-contexts --out results/batch_shared_contexts.md
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.machine import describe  # noqa: E402

TOPICS = {
    "API key": [
        "How do I rotate the API key?",
        "When must the API key be rotated?",
        "What if the API key leaked?",
        "Where is a new API key stored?",
    ],
    "leave": [
        "How many days of annual leave do I get?",
        "Who approves my leave?",
        "How much leave carries over?",
        "Do sick days count against leave?",
    ],
    "deploy": [
        "How do we deploy to production?",
        "Can I deploy on Friday?",
        "What is a canary release?",
        "Which tool syncs production deploys?",
    ],
    "backups": [
        "How long are backups kept?",
        "How do I restore the database to a point in time?",
        "When does the restore drill run?",
        "Where are write-ahead logs archived?",
    ],
    "on-call": [
        "How much is an on-call week paid?",
        "How fast must I acknowledge a page?",
        "Who do I escalate to when on call?",
        "What goes in the on-call handover?",
    ],
}

BATCHER_NOTES = (
    "Tokens reused: summed over the answers' stats. Before, groups ran one after another, so chunks one "
    "group prefilled were in the prefix cache for the next; after, questions admitted together each prefill "
    "the chunks after their first (the prefix cache serves a combination only once one question has computed "
    "it), which is what grouping still saves at top-5, and the KV load time is counted as `ask` counts it "
    "(before: 0). After, the answers' uses also reach the store's popularity (before: none)."
)

# What `--preset` fills in: title, what the before and after trees are, the notes.
PRESETS = {
    "shared-contexts": (
        "Questions over one context admitted together: before and after they share its prefill",
        "each question admitted in a step prefilled the chunks after its first",
        "a question takes from the prefix cache what one admitted with it prefilled, as its own prefill starts",
        "Tokens reused: summed over the answers' stats. The old grouped batch (c472a9f, "
        "benchmarks/results/batch.md, the same questions and settings) reused 5183 tokens at top-1 and 6825 at "
        "top-5.",
    )
}

# Runs in a fresh python whose sys.path starts with the tree measured.
WORKER = r"""
import json, sys, time
tree, store, questions, top_k, tokens, max_batch = sys.argv[1:7]
sys.path.insert(0, tree)
import torch
torch.set_num_threads(torch.get_num_threads())
import ragkv
try:
    from ragkv.engine.batch import Question, answer_all
    from ragkv.core.config import AskSettings
except ImportError:  # a tree from before the layer packages (issue 55)
    from ragkv.batch import Question, answer_all
    from ragkv.config import AskSettings
qs = [Question(str(i), q) for i, q in enumerate(json.loads(questions))]
settings = AskSettings(top_k=int(top_k), max_new_tokens=int(tokens))
with ragkv.open(store, device="cpu") as engine:
    engine.ask(qs[0].question, top_k=int(top_k), max_new_tokens=2)  # warm up
    start = time.perf_counter()
    outcomes = list(answer_all(engine, qs, settings, max_batch=int(max_batch)))
    seconds = time.perf_counter() - start
    answers = {o.question.id: o.answer for o in outcomes}
    print(json.dumps({
        "seconds": seconds,
        "token_ids": {i: a.token_ids for i, a in answers.items()},
        "reused_tokens": sum(a.stats.reused_tokens for a in answers.values()),
        "computed_tokens": sum(a.stats.computed_tokens for a in answers.values()),
        "prompt_tokens": sum(a.stats.prompt_tokens for a in answers.values()) / len(answers),
        "kv_load_ms": sum(a.stats.kv_load_ms for a in answers.values()),
        "max_batch_size": max(a.stats.batch_size for a in answers.values()),
    }))
"""


def run_worker(worker: str, tree: Path, *args: str, python: str = sys.executable) -> dict:
    """`worker` run by `python` in a fresh process inside `tree` (its argv: the tree, then `args`);
    the JSON object its last line prints."""
    out = subprocess.run([python, "-c", worker, str(tree), *args], capture_output=True, text=True, cwd=tree)
    if out.returncode:
        raise SystemExit(f"{tree}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(
    python: str, tree: Path, store: Path, questions: list[str], top_k: int, tokens: int, max_batch: int
) -> dict:
    args = (str(store), json.dumps(questions), str(top_k), str(tokens), str(max_batch))
    return run_worker(WORKER, tree, *args, python=python)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="the other source tree (a git worktree)")
    parser.add_argument("--after", type=Path, default=ROOT, help="the tree measured against it (default: this one)")
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "batch.md")
    parser.add_argument("--title", default="`ragkv batch` before and after it moved onto the continuous batcher")
    parser.add_argument(
        "--before-is", default="questions grouped by shared context, padded batch prefill, its own decode loop"
    )
    parser.add_argument("--after-is", default="every question a turn of the Batcher")
    parser.add_argument("--notes", default=BATCHER_NOTES, help="the paragraph under the table")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="title, trees and notes of a named comparison")
    args = parser.parse_args()
    if args.preset:
        args.title, args.before_is, args.after_is, args.notes = PRESETS[args.preset]
    before_commit = subprocess.run(
        ["git", "-C", str(args.before), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    after_commit = subprocess.run(
        ["git", "-C", str(args.after), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    questions = [q for qs in TOPICS.values() for q in qs]
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "store"
        subprocess.run(
            [
                sys.executable,
                str(ROOT / "cli.py"),
                "ingest",
                str(ROOT / "data"),
                "--store",
                str(store),
                "--device",
                "cpu",
                "--quiet",
            ],
            check=True,
            cwd=ROOT,
        )
        for top_k in (1, 5):
            runs: dict[str, list[dict]] = {"before": [], "after": []}
            for _ in range(args.repeats):
                for name, tree in trees.items():
                    runs[name].append(
                        measure(sys.executable, tree, store, questions, top_k, args.tokens, args.max_batch)
                    )
                    print(f"top-{top_k} {name}: {len(questions) / runs[name][-1]['seconds']:.2f} q/s", file=sys.stderr)
            rows.append((top_k, runs))
    lines = [
        f"# {args.title}",
        "",
        f"Bundled SmolLM2-135M-Instruct, float32, the sample corpus, CPU ({describe()}); {len(questions)} questions "
        f"({len(TOPICS)} topics, 4 phrasings each), greedy, {args.tokens} new tokens, --max-batch {args.max_batch}. "
        f"before: {before_commit} ({args.before_is}); "
        f"after: {after_commit} ({args.after_is}). Each run a fresh process, warm (one question "
        f"first), trees alternating, {args.repeats} runs each; questions/s is the median, the range in brackets. "
        f"Command: `python benchmarks/batch_throughput.py {shlex.join(sys.argv[1:])}`.",
        "",
        "| prompts | mean prompt tokens | before (questions/s) | after (questions/s) | after / before | "
        "answers identical | tokens reused, before / after | KV load ms counted, before / after |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for top_k, runs in rows:
        qps = {n: [len(questions) / r["seconds"] for r in rs] for n, rs in runs.items()}
        med = {n: statistics.median(v) for n, v in qps.items()}
        same = sum(
            runs["before"][0]["token_ids"][i] == runs["after"][0]["token_ids"][i] for i in runs["after"][0]["token_ids"]
        )
        b, a = runs["before"][0], runs["after"][0]
        lines.append(
            f"| top-{top_k} | {a['prompt_tokens']:.0f} | {med['before']:.2f} [{min(qps['before']):.2f}–"
            f"{max(qps['before']):.2f}] | {med['after']:.2f} [{min(qps['after']):.2f}–{max(qps['after']):.2f}] | "
            f"{med['after'] / med['before']:.2f}× | {same}/{len(questions)} | {b['reused_tokens']} / "
            f"{a['reused_tokens']} | {b['kv_load_ms']:.0f} / {a['kv_load_ms']:.0f} |"
        )
    lines += ["", args.notes, ""]
    args.out.write_text("\n".join(lines))
    print(args.out.read_text())


if __name__ == "__main__":
    main()
