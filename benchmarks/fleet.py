"""A fleet on S3 against one replica on a local folder, on the same Zipf trace, in one run.

Python library reference pages (Debian's python3.11-doc; chunks of 256 tokens), no chunk KV
precomputed (every chunk is first met on the trace), the bundled SmolLM2 float32 on CPU, one
client asking in order (`--clients 2`: two at once, on the fleet one per replica), one token
per answer:
- local: one `ragkv serve` on a folder store: each miss is written back at once;
- fleet: two `ragkv serve` on one S3 store (SeaweedFS on loopback), each with its own mirror.
  Replica A is started with `--writer --fold-every N`; B only reads. The trace goes
  round-robin. At two thirds of it B is killed with -9 right after answering a miss (its
  write-back uploading), and A answers the rest.

Reported: the hit rate (uses whose KV was ready, from the store or RAM) per window of the
trace, against the ceiling (a chunk's first use is a compulsory miss); bytes uploaded per
request; how often the fleet computed one chunk more than once within a fold interval; after
the kill, A's failed requests and what the next fold found.

    python benchmarks/fleet.py [--work DIR] [--tokens 60000] [--questions 1500] [--fold-every 60]
                               [--clients 1|2] [--out benchmarks/results/fleet.md]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.corpus_scale import corpus, ingest, questions_for  # noqa: E402
from benchmarks.fidelity import work_dir  # noqa: E402
from benchmarks.machine import describe  # noqa: E402
from benchmarks.serve_load import Server  # noqa: E402
from ragkv.core.config import cache_dir  # noqa: E402
from ragkv.model.llm import load_model  # noqa: E402
from ragkv.store import open_snapshot, verify  # noqa: E402
from ragkv.store.kv.writeback import fold  # noqa: E402
from tests import s3server  # noqa: E402

WINDOW = 100
MODELS = cache_dir() / "models"


def serve(store: str, home: Path, *args: str) -> Server:
    """`ragkv serve` of `store` with its own cache (mirror) under `home`."""
    home.mkdir(parents=True, exist_ok=True)
    if not (home / "models").exists():
        (home / "models").symlink_to(MODELS)
    command = [sys.executable, "-m", "ragkv", "serve", "--store", store, "--port", "{port}"]
    return Server([*command, "--device", "cpu", *args], env={"RAGKV_HOME": str(home)})


def ask(base: str, question: str) -> dict:
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": 1, "ragkv": {"context": "chunk"}}
    started = time.perf_counter()
    reply = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=600)
    reply.raise_for_status()
    extra = reply.json()["ragkv"]
    return {
        "t": time.time(),
        "s": time.perf_counter() - started,
        "source": extra["stats"]["kv_source"] or "live",
        "chunk": extra["sources"][0]["chunk_id"],
    }


def metric(base: str, name: str) -> float:
    lines = [line for line in httpx.get(f"{base}/metrics").text.splitlines() if line.startswith(f"{name} ")]
    return float(lines[0].split()[1]) if lines else 0.0


def in_turn(questions: list[str], clients: int, ask_one) -> None:
    """Ask every question with `ask_one(i, question)`: in order with one client; with two,
    client k asks questions k, k + 2, ... in order, both at once."""
    if clients == 1:
        for i, question in enumerate(questions):
            ask_one(i, question)
        return
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(lambda k: [ask_one(i, questions[i]) for i in range(k, len(questions), clients)], range(clients)))


def run_local(store: Path, home: Path, questions: list[str], clients: int) -> list[dict]:
    server = serve(str(store), home)
    rows: list[dict] = []
    try:
        in_turn(questions, clients, lambda i, q: rows.append({**ask(server.base, q), "i": i}))
    finally:
        server.stop()
    return sorted(rows, key=lambda r: r["i"])


def run_fleet(uri: str, work: Path, questions: list[str], fold_every: float, clients: int) -> dict:
    """The trace round-robin over replicas A (the writer) and B; B killed -9 at two thirds."""
    a = serve(uri, work / "home-a", "--writer", "--fold-every", str(fold_every))
    b = serve(uri, work / "home-b")
    rows: list[dict] = []
    kill_at, failed, uploaded = 2 * len(questions) // 3, [], [0.0]
    killed: dict = {}
    lock = threading.Lock()

    def ask_one(i: int, question: str) -> None:
        target = a if (i % 2 == 0 or killed) else b
        try:
            row = ask(target.base, question)
        except httpx.HTTPError:
            failed.append(i)
            return
        rows.append({**row, "i": i, "replica": "a" if target is a else "b"})
        with lock:
            if i >= kill_at and not killed and target is b and row["source"] == "computed":
                uploaded[0] += metric(b.base, "ragkv_pending_uploaded_bytes")
                b.process.send_signal(signal.SIGKILL)  # its write-back is uploading this miss's KV
                b.process.wait()
                killed.update({"at": i, "pending": pending_names(uri)})

    try:
        in_turn(questions, clients, ask_one)
        uploaded[0] += metric(a.base, "ragkv_pending_uploaded_bytes")
        folds = metric(a.base, "ragkv_folds")
    finally:
        a.stop()
        if b.process.poll() is None:
            b.stop()
    after = fold(uri)  # what the kill left: a shard without its manifest is never taken
    with open_snapshot(uri) as snapshot:
        ok = verify(snapshot).ok
    return {
        "rows": sorted(rows, key=lambda r: r["i"]),
        "failed": len(failed),
        "uploaded": uploaded[0],
        "folds": folds,
        "killed": killed,
        "fold_after": after.to_dict(),
        "verify_ok": ok,
    }


def pending_names(uri: str) -> list[str]:
    from ragkv.store.kv.pending import PendingArea

    return sorted(PendingArea(uri).names())


def hit_rate(rows: list[dict]) -> float:
    return sum(r["source"] in ("store", "ram") for r in rows) / max(len(rows), 1)


def ceiling(rows: list[dict]) -> list[bool]:
    """Per row, whether a perfect learner hits (the chunk was used before)."""
    seen, out = set(), []
    for r in rows:
        out.append(r["chunk"] in seen)
        seen.add(r["chunk"])
    return out


def duplicate_computes(rows: list[dict], fold_every: float) -> tuple[int, int]:
    """(chunks computed more than once within one fold interval, misses in all)."""
    start = rows[0]["t"]
    computed = Counter((int((r["t"] - start) // fold_every), r["chunk"]) for r in rows if r["source"] == "computed")
    return sum(1 for n in computed.values() if n > 1), sum(computed.values())


def windows(rows: list[dict]) -> list[tuple[int, float, float]]:
    """Per window of WINDOW questions: its end, the hit rate, the ceiling's."""
    best = ceiling(rows)
    return [
        (
            i + len(rows[i : i + WINDOW]),
            hit_rate(rows[i : i + WINDOW]),
            sum(best[i : i + WINDOW]) / len(best[i : i + WINDOW]),
        )
        for i in range(0, len(rows), WINDOW)
    ]


def render(local: list[dict], fleet: dict, args, tokens: int, chunks: int) -> str:
    lw, fw = windows(local), windows(fleet["rows"])
    tail = max(len(local) // 5, 1)
    local_final, fleet_final = hit_rate(local[-tail:]), hit_rate(fleet["rows"][-tail:])
    dups, misses = duplicate_computes(fleet["rows"], args.fold_every)
    local_dups, local_misses = duplicate_computes(local, args.fold_every)
    clients = (
        "one client asking in order"
        if args.clients == 1
        else "two clients at once, each asking every other question in order (on the fleet each client its own replica)"
    )
    lines = [
        "# A fleet on S3: two replicas, one writer",
        "",
        f"{describe()}. Command: `python benchmarks/fleet.py --tokens {args.tokens} --questions "
        f"{args.questions} --fold-every {args.fold_every:g}{' --clients 2' if args.clients == 2 else ''}`.",
        "",
        f"Python library reference pages ({tokens:,} tokens, {chunks} chunks of 256 tokens), no chunk KV "
        f"precomputed, {args.questions} questions drawn by Zipf(1.1), {clients}, one token per "
        "answer, SmolLM2-135M float32 on CPU. Local: one `ragkv serve` on a folder store. Fleet: two "
        "`ragkv serve` on one S3 store (SeaweedFS on loopback), A with `--writer --fold-every "
        f"{args.fold_every:g}`, B a reader; the trace round-robin, B killed -9 at two thirds.",
        "",
        "| | local, 1 replica | S3, 2 replicas |",
        "|---|---|---|",
        f"| hit rate, whole trace | {hit_rate(local):.1%} | {hit_rate(fleet['rows']):.1%} |",
        f"| hit rate, last fifth of the trace | {local_final:.1%} | {fleet_final:.1%} "
        f"({fleet_final / local_final:.0%} of local) |",
        f"| ceiling (first uses are the only misses), whole trace | {sum(ceiling(local)) / len(local):.1%} | "
        f"{sum(ceiling(fleet['rows'])) / len(fleet['rows']):.1%} |",
        f"| misses | {local_misses} | {misses} |",
        f"| chunks computed more than once in one fold interval | {local_dups} | {dups} |",
        f"| mean request s | {sum(r['s'] for r in local) / len(local):.3f} | "
        f"{sum(r['s'] for r in fleet['rows']) / len(fleet['rows']):.3f} |",
        f"| bytes uploaded per request (pending KV and uses) | 0 | {fleet['uploaded'] / len(fleet['rows']):,.0f} |",
        f"| folds by the writer replica | - | {fleet['folds']:.0f} |",
        "",
        "## Hit rate over the trace",
        "",
        "| questions | local | fleet | ceiling (local trace) |",
        "|---|---|---|---|",
        *[f"| {end} | {lr:.0%} | {fr:.0%} | {lc:.0%} |" for (end, lr, lc), (_, fr, _) in zip(lw, fw, strict=False)],
        "",
        "## Kill -9 of replica B mid-upload",
        "",
        f"- B was killed after question {fleet['killed'].get('at')} (a miss), with these pending objects "
        f"in the bucket: {len(fleet['killed'].get('pending', []))}.",
        f"- Requests that failed on A afterwards: {fleet['failed']} (every request after the kill went to A).",
        f"- The fold after the run: `{json.dumps(fleet['fold_after'])}`; `verify` "
        f"{'passed' if fleet['verify_ok'] else 'FAILED'}.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--tokens", type=int, default=60000)
    parser.add_argument("--questions", type=int, default=1500)
    parser.add_argument("--fold-every", type=float, default=60.0)
    parser.add_argument(
        "--clients", type=int, choices=(1, 2), default=1, help="2: one client per replica, both at once"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "fleet.md")
    args = parser.parse_args()
    work = work_dir(args.work, "fleet")
    tokenizer = load_model("smollm2", "cpu", "float32").tokenizer
    docs, tokens = corpus(work, args.tokens, tokenizer)
    local = work / "local"
    if local.exists():
        shutil.rmtree(local)
    ingest(docs, local, precompute=0)
    questions, _ = questions_for(local, args.questions, seed=7)
    with open_snapshot(local) as snapshot:
        chunks = len(snapshot.catalog.documents.chunk_ids())
    print(f"{tokens} tokens, {chunks} chunks, {len(questions)} questions", flush=True)
    with s3server.s3_server(work / f"weed-{os.getpid()}") as endpoint:
        os.environ.update(s3server.environment(endpoint))
        uri = f"s3://ragkv/fleet-{os.getpid()}"
        ingest(docs, uri, precompute=0)
        print("local replica", flush=True)
        local_rows = run_local(local, work / "home-local", questions, args.clients)
        print(f"  hit rate {hit_rate(local_rows):.1%}", flush=True)
        print("fleet", flush=True)
        fleet = run_fleet(uri, work, questions, args.fold_every, args.clients)
        print(f"  hit rate {hit_rate(fleet['rows']):.1%}", flush=True)
    text = render(local_rows, fleet, args, tokens, chunks)
    args.out.write_text(text)
    (work / "fleet.json").write_text(json.dumps({"local": local_rows, "fleet": fleet}))  # every request
    print(text)


if __name__ == "__main__":
    main()
