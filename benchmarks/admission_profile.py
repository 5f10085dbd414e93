"""Where the own engine's time goes while clients stream (issue 64: measure first, beyond the decode step).

`decode_profile.py` times one decode step in isolation; at 8 streaming clients the engine also
admits a request every few steps (retrieval, the stored KV loaded and assembled into the
request's cache), copies its row into the batch, and feeds its question in with a decode step.
This runs that workload in one process, with the engine stepping in its background thread as
`ragkv serve` does, and sums the wall time of each part of the step loop (timers wrapped around
the engine's own methods; nested parts are listed under their parent):

- the pages are decode_speed.py's (library reference pages of python3.11-doc, ~820 tokens, one
  chunk each), every question asked once first so the RAM tier is warm (decode_speed's *again*),
  on the main thread, as a program that asks and then batches does;
- `--clients` threads each ask `--per-client` questions of 32 tokens, greedy;
- each variant in a fresh process, alternating, `--repeats` times: *freed* is the engine as it
  is (`Engine.start` frees the starting thread's idle OpenMP workers: ragkv.core.cpu
  `release_idle_threads`), *kept* the same with that call made a no-op (the engine before it).

    python benchmarks/admission_profile.py [--work DIR] [--clients 8] [--per-client 3] [--repeats 2]   # writes results/admission_profile.md
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.decode_speed import page_store  # noqa: E402
from benchmarks.fidelity import work_dir  # noqa: E402
from benchmarks.machine import describe  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "admission_profile.md"
TOKENS = 32

spent: dict[str, list[float]] = defaultdict(list)


def timed(owner, name: str, label, only_engine_thread: bool = True) -> None:
    """Wrap `owner.name` to add its wall time to `spent[label]` (`label(self, *args)` may name
    the part from the call's arguments)."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        if only_engine_thread and threading.current_thread().name != "ragkv-engine":
            return original(self, *args, **kwargs)
        kind = label(self, *args) if callable(label) else label
        began = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            spent[kind].append(time.perf_counter() - began)

    setattr(owner, name, wrapper)


def instrument() -> None:
    from ragkv.engine.engine import Engine
    from ragkv.engine.request import Request
    from ragkv.engine.runner import Runner
    from ragkv.engine.runtime import Runtime
    from ragkv.kv.ragged import RaggedBatch
    from ragkv.loading.loader import KVLoader
    from ragkv.retrieval.retriever import Retriever

    timed(Engine, "_step", "step loop")
    timed(Request, "admit", "  admission")
    timed(Runtime, "prepare", "    prepare (retrieval + stored KV)")
    timed(Retriever, "prompt_for", "      retrieval (embed, search, prompt ids)")
    timed(KVLoader, "load", "      stored KV (RAM tier, assembled into the request's cache)")
    timed(Engine, "_prefill", "  prefill call (a riding prompt: its row joins)")
    timed(RaggedBatch, "add", "    row copied into the batch's slot")
    timed(
        Runner,
        "decode",
        lambda runner: "  decode step with a prompt packed in" if runner.filling else "  decode step",
    )
    timed(RaggedBatch, "step_packed", "    the forward (packed step)")
    timed(Runner, "_take", "    each row's next token picked (Decoder, text)")
    timed(Runner, "_leave", "    rows leave (KV handed back to their caches)")
    timed(Request, "finish", "  finish (the answer)")


def run(store: Path, asked: list[str], clients: int, per_client: int) -> tuple[float, int]:
    import ragkv
    from ragkv.core.config import AskSettings

    settings = AskSettings(top_k=1, max_new_tokens=TOKENS)
    with ragkv.open(store, device="cpu") as rag:
        work = asked[: clients * per_client]
        for question in [*work, asked[-1]]:  # the RAM tier warm (decode_speed's "again"), the process too
            rag.ask(question, AskSettings(top_k=1, max_new_tokens=1))
        instrument()
        generated = 0
        with rag.batched(max_batch=16):
            began = time.perf_counter()

            def client(index: int) -> int:
                return sum(
                    len(rag.ask(q, settings).token_ids) for q in work[index * per_client : (index + 1) * per_client]
                )

            with ThreadPoolExecutor(clients) as pool:
                generated = sum(pool.map(client, range(clients)))
            wall = time.perf_counter() - began
    return wall, generated


def measure(store: Path, asked: list[str], clients: int, per_client: int, variant: str) -> dict:
    """One run in this process: the totals and medians per part, the wall time and tokens."""
    if variant == "kept":
        import ragkv.engine.engine

        ragkv.engine.engine.release_idle_threads = lambda: False  # the engine before the fix
    wall, generated = run(store, asked, clients, per_client)
    return {
        "wall": wall,
        "generated": generated,
        "parts": {kind: [sum(v), len(v), statistics.median(v)] for kind, v in spent.items()},
    }


ORDER = [  # the rows of the table, parents before their parts
    "step loop",
    "  admission",
    "    prepare (retrieval + stored KV)",
    "      retrieval (embed, search, prompt ids)",
    "      stored KV (RAM tier, assembled into the request's cache)",
    "  prefill call (a riding prompt: its row joins)",
    "    row copied into the batch's slot",
    "  decode step",
    "  decode step with a prompt packed in",
    "    the forward (packed step)",
    "    each row's next token picked (Decoder, text)",
    "    rows leave (KV handed back to their caches)",
    "  finish (the answer)",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--work", type=Path, default=None, help="where python3.11-doc, the pages and the store are kept"
    )
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--per-client", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2, help="fresh processes per variant, alternating")
    parser.add_argument("--variant", choices=["freed", "kept"], help=argparse.SUPPRESS)  # one run, JSON out
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    torch.set_num_threads(2)
    needed = args.clients * args.per_client + 1
    work = work_dir(args.work, "admission")
    store, asked = page_store(work, needed)
    if args.variant:
        print("RESULT " + json.dumps(measure(store, asked, args.clients, args.per_client, args.variant)))
        return
    runs: dict[str, list[dict]] = {"freed": [], "kept": []}
    for repeat in range(args.repeats):
        for variant in ("kept", "freed") if repeat % 2 == 0 else ("freed", "kept"):
            command = [sys.executable, __file__, "--work", str(work), "--variant", variant]
            command += ["--clients", str(args.clients), "--per-client", str(args.per_client)]
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            (line,) = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
            runs[variant].append(json.loads(line.removeprefix("RESULT ")))
            print(variant, f"{runs[variant][-1]['generated'] / runs[variant][-1]['wall']:.1f} tokens/s", flush=True)
    write(args, runs)


def write(args, runs: dict[str, list[dict]]) -> None:
    requests = args.clients * args.per_client
    mid = {v: sorted(r, key=lambda x: x["generated"] / x["wall"])[len(r) // 2] for v, r in runs.items()}
    lines = [
        f"# Where the own engine's step loop spends its time at {args.clients} streaming clients (issue 64)",
        "",
        f"Generated by `python benchmarks/admission_profile.py --clients {args.clients} --per-client "
        f"{args.per_client} --repeats {args.repeats}` on {describe()}. SmolLM2-135M-Instruct, float32, in one "
        "process: the engine steps in its background thread (as in `ragkv serve`), "
        f"{args.clients} client threads ask {args.per_client} questions each ({TOKENS} tokens, greedy, top-1 "
        "chunk: library reference pages of python3.11-doc, ~820 tokens each, prompts ~880 tokens), every page's KV "
        "in the RAM tier first (decode_speed's *again*), asked on the main thread before the engine's thread "
        "starts, as a program that asks and then batches does (`ragkv serve`'s main thread runs no parallel op "
        "first, and is not affected). *freed*: the engine as it is, `Engine.start` freeing the "
        "starting thread's idle OpenMP workers (`ragkv.core.cpu.release_idle_threads`); *kept*: that call made a "
        f"no-op. Each variant {args.repeats} times, each run a fresh process, alternating; the table shows the "
        "run with the median tokens/s of each. Wall time summed per part of the step loop (nested parts indented "
        "under their parent).",
        "",
        "| variant | run | tokens/s | requests/s |",
        "|---|---|---|---|",
    ]
    for variant, results in runs.items():
        for i, r in enumerate(results):
            lines.append(f"| {variant} | {i + 1} | {r['generated'] / r['wall']:.1f} | {requests / r['wall']:.2f} |")
    lines += [
        "",
        "| part | kept: total s | kept: ms per call (median) | freed: total s | freed: ms per call (median) |",
        "|---|---|---|---|---|",
    ]
    for kind in ORDER:
        cells = []
        for variant in ("kept", "freed"):
            total, _, median = mid[variant]["parts"].get(kind, [0.0, 0, 0.0])
            cells += [f"{total:.2f}", f"{1000 * median:.1f}"]
        name = "&nbsp;" * (len(kind) - len(kind.lstrip())) + kind.strip()
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    kept, freed = (statistics.median(r["generated"] / r["wall"] for r in runs[v]) for v in ("kept", "freed"))
    lines += ["", f"Median tokens/s, freed over kept: {freed / kept:.2f}x ({freed:.1f} against {kept:.1f})."]
    text = "\n".join(lines) + "\n"
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
