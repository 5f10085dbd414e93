"""One engine, before and after: two source trees side by side in one run (`--before TREE`, e.g.
`git worktree add ../before 230302c`, the last commit with two engines: `generate()` for `ask`
and the Batcher for `ragkv batch` and the service). Each measurement is a fresh process that
imports its tree's ragkv, opens the same store and warms up with one question; the trees
alternate, `--repeats` times each.

Workloads on the bundled SmolLM2 in float32 over the sample corpus, top-1, greedy:
- `ask`, one after another in one thread: time to first token and seconds per answer (the
  engine's own stepping against the old plain loop: what one user waits);
- `ask` from `--threads` threads at once, no batcher: answers/s, the largest batch an answer
  decoded in, and whether the answers equal the one-at-a-time ones;
- `ragkv batch` (`answer_all`) over the same questions: answers/s;
- `ragkv serve` of each tree, streaming chat completions from 1 and 8 clients (the questions
  of benchmarks/questions.txt, once per client level at 1, twice at 8; the server warmed by one
  pass first): requests/s and the median and p90 time to first token, client side.

    python benchmarks/one_engine.py --before ../before [--after ../after] [--repeats 3] [--threads 4]
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

from benchmarks.batch_throughput import TOPICS, run_worker  # noqa: E402
from benchmarks.machine import describe  # noqa: E402
from benchmarks.serve_load import QUESTIONS as SERVE_QUESTIONS  # noqa: E402
from benchmarks.serve_load import level, ragkv_server, stream_ragkv  # noqa: E402

SERVE_CLIENTS = (1, 8)

# Runs in a fresh python whose sys.path starts with the tree measured.
WORKER = r"""
import json, sys, threading, time
tree, store, questions, tokens, threads = sys.argv[1:6]
sys.path.insert(0, tree)
import ragkv
try:
    from ragkv.engine.batch import Question, answer_all
    from ragkv.core.config import AskSettings
except ImportError:  # a tree from before the layer packages (issue 55)
    from ragkv.batch import Question, answer_all
    from ragkv.config import AskSettings
questions, tokens, threads = json.loads(questions), int(tokens), int(threads)
settings = AskSettings(top_k=1, max_new_tokens=tokens)
result = {}
with ragkv.open(store, device="cpu") as engine:
    engine.ask(questions[0], settings)  # warm up
    start = time.perf_counter()
    alone = [engine.ask(q, settings) for q in questions]
    result["sequential_s"] = time.perf_counter() - start
    result["ttft_s"] = sorted(a.stats.ttft_s for a in alone)[len(alone) // 2]
    answers, errors = {}, []
    def worker(part):
        for i in part:
            try:
                answers[i] = engine.ask(questions[i], settings)
            except Exception as error:  # a tree whose ask is not thread-safe
                errors.append(f"{type(error).__name__}: {error}"[:200])
    parts = [range(n, len(questions), threads) for n in range(threads)]
    workers = [threading.Thread(target=worker, args=(p,)) for p in parts]
    start = time.perf_counter()
    for w in workers: w.start()
    for w in workers: w.join()
    result["threads_s"] = time.perf_counter() - start
    result["threads_errors"] = errors
    result["threads_identical"] = sum(i in answers and answers[i].token_ids == a.token_ids for i, a in enumerate(alone))
    result["threads_max_batch"] = max((a.stats.batch_size for a in answers.values()), default=0)
    qs = [Question(str(i), q) for i, q in enumerate(questions)]
    start = time.perf_counter()
    outcomes = list(answer_all(engine, qs, settings, max_batch=16))
    result["batch_s"] = time.perf_counter() - start
    result["batch_identical"] = sum(o.answer.token_ids == alone[int(o.question.id)].token_ids for o in outcomes)
    result["token_ids"] = [a.token_ids for a in alone]
print(json.dumps(result))
"""


def measure(tree: Path, store: Path, questions: list[str], tokens: int, threads: int) -> dict:
    return run_worker(WORKER, tree, str(store), json.dumps(questions), str(tokens), str(threads))


def measure_serve(tree: Path, store: Path, tokens: int) -> dict:
    """requests/s and median TTFT of `ragkv serve` from `tree` at each of SERVE_CLIENTS."""
    server = ragkv_server(store, 16, tree)
    try:

        def call(question: str, ids: list[int], n: int):
            return stream_ragkv(server.base, question, ids, n)

        work: list[tuple[str, list[int]]] = [(q, []) for q in SERVE_QUESTIONS]
        level(call, 4, work, tokens)  # warm: every document read once, the RAM tier filled
        result = {}
        for clients in SERVE_CLIENTS:
            row = level(call, clients, work * (1 if clients == 1 else 2), tokens)
            if row["errors"]:
                raise SystemExit(f"{tree}: {row['errors']} serve requests failed")
            result[clients] = {"rps": row["rps"], "p50": row["p50"], "p90": row["p90"]}
        return result
    finally:
        server.stop()


def commit_of(tree: Path) -> str:
    out = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(
        ["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
    )
    return out.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="the other source tree (a git worktree)")
    parser.add_argument("--after", type=Path, default=ROOT, help="the tree measured against it (default: this one)")
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--serve-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "one_engine.md")
    parser.add_argument("--title", default="One engine: `ask`, threads and `ragkv batch` before and after")
    parser.add_argument(
        "--before-is",
        default="`ask` on its own loop, `generate()`; batch and serve on the Batcher's model thread",
        help="what the before tree is, for the results' header",
    )
    parser.add_argument(
        "--after-is",
        default="one engine: every answer a turn of one scheduler, stepped by the waiting caller",
        help="what the after tree is, for the results' header",
    )
    args = parser.parse_args()
    questions = [q for qs in TOPICS.values() for q in qs]
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "store"
        # written by the before tree: a newer ragkv reads an older catalog, not the other way round
        before = trees["before"]
        ingest = [sys.executable, str(before / "cli.py"), "ingest", str(ROOT / "data"), "--store", str(store)]
        subprocess.run([*ingest, "--device", "cpu", "--quiet"], check=True, cwd=before)
        for _ in range(args.repeats):
            for name, tree in trees.items():
                runs[name].append(measure(tree, store, questions, args.tokens, args.threads))
                r = runs[name][-1]
                r["serve"] = measure_serve(tree, store, args.serve_tokens)
                print(
                    f"{name}: ttft {r['ttft_s'] * 1000:.0f} ms, sequential {r['sequential_s']:.1f} s, "
                    f"threads {r['threads_s']:.1f} s, batch {r['batch_s']:.1f} s, serve {r['serve']}",
                    file=sys.stderr,
                )

    def values(name: str, key: str, scale: float = 1.0, invert: bool = False) -> list[float]:
        return [len(questions) / r[key] if invert else r[key] * scale for r in runs[name]]

    def show(vs: list[float]) -> str:
        return f"{statistics.median(vs):.2f} [{min(vs):.2f}–{max(vs):.2f}]"

    def ratio(before: list[float], after: list[float]) -> str:
        """after / before of the medians, and the range of the runs' paired ratios (run i of
        each tree ran back to back, so a pair shares the machine's state of the moment)."""
        pairs = [x / y for x, y in zip(after, before, strict=True)]
        return f"{statistics.median(after) / statistics.median(before):.2f}× [{min(pairs):.2f}–{max(pairs):.2f}]"

    def row(label: str, before: list[float], after: list[float], equal: str) -> str:
        return f"| {label} | {show(before)} | {show(after)} | {ratio(before, after)} | {equal} |"

    n = len(questions)
    b, a = runs["before"], runs["after"]
    same = sum(x == y for x, y in zip(b[0]["token_ids"], a[0]["token_ids"], strict=True))
    lines = [
        f"# {args.title}",
        "",
        f"Bundled SmolLM2-135M-Instruct, float32, the sample corpus, top-1, greedy, {args.tokens} new tokens, "
        f"{n} questions ({len(TOPICS)} topics, 4 phrasings each); CPU: {describe()}. "
        f"before: {commit_of(trees['before'])} ({args.before_is}); after: {commit_of(trees['after'])} "
        f"({args.after_is}). Each run a fresh process, warm (one question first), trees "
        f"alternating, {args.repeats} runs each: the median, the range in brackets; after / before: the "
        "medians' ratio, in brackets the range of the paired runs' ratios. "
        f"Command: `python benchmarks/one_engine.py {' '.join(shlex.quote(a) for a in sys.argv[1:])}`.",
        "",
        "| workload | before | after | after / before | answers equal to one at a time, before / after |",
        "|---|---|---|---|---|",
        row(
            "`ask` one at a time: median time to first token (ms)",
            values("before", "ttft_s", 1000),
            values("after", "ttft_s", 1000),
            "(the reference)",
        ),
        row(
            "`ask` one at a time: answers/s",
            values("before", "sequential_s", invert=True),
            values("after", "sequential_s", invert=True),
            "(the reference)",
        ),
        row(
            f"`ask` from {args.threads} threads, no batcher: answers/s",
            values("before", "threads_s", invert=True),
            values("after", "threads_s", invert=True),
            f"{min(r['threads_identical'] for r in b)}/{n} / {min(r['threads_identical'] for r in a)}/{n}",
        ),
        row(
            "`ragkv batch`: answers/s",
            values("before", "batch_s", invert=True),
            values("after", "batch_s", invert=True),
            f"{min(r['batch_identical'] for r in b)}/{n} / {min(r['batch_identical'] for r in a)}/{n}",
        ),
    ]
    for clients in SERVE_CLIENTS:
        rps = {name: [r["serve"][clients]["rps"] for r in runs[name]] for name in runs}
        p50 = {name: [r["serve"][clients]["p50"] * 1000 for r in runs[name]] for name in runs}
        p90 = {name: [r["serve"][clients]["p90"] * 1000 for r in runs[name]] for name in runs}
        who = f"{clients} client{'s' if clients > 1 else ''}"
        lines += [
            row(f"`ragkv serve`, {who}: requests/s", rps["before"], rps["after"], ""),
            row(f"`ragkv serve`, {who}: median time to first token (ms)", p50["before"], p50["after"], ""),
            row(f"`ragkv serve`, {who}: p90 time to first token (ms)", p90["before"], p90["after"], ""),
        ]
    lines += [
        "",
        f"- Largest batch a threaded `ask` decoded in: before {max(r['threads_max_batch'] for r in b)}, "
        f"after {max(r['threads_max_batch'] for r in a)}.",
        f"- One-at-a-time answers identical between the trees: {same}/{n}.",
        f"- Serve: {args.serve_tokens} new tokens, streaming; time-to-first-token ratios below 1 and rate ratios "
        "above 1 favour after.",
    ]
    errors = [e for r in b + a for e in r["threads_errors"]]
    if errors:
        lines.append(f"- Threaded `ask` errors: {len(errors)}, e.g. `{errors[0]}`.")
    args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
