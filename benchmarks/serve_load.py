"""Load on `ragkv serve`: N concurrent clients against the sample corpus on the bundled
SmolLM2: streaming (throughput, client-side time to first token p50/p99), and non-streaming
popular questions with batching on and off (throughput, latency, batch sizes); errors must be 0.

    python benchmarks/serve_load.py [--clients 1,4,8] [--requests 24] [--tokens 32]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.machine import describe  # noqa: E402

QUESTIONS = (ROOT / "benchmarks" / "questions.txt").read_text().splitlines()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_request(base: str, question: str, tokens: int) -> tuple[float, float, int, str | None]:
    """(TTFT, total seconds, content chunks, error) of one streaming chat completion."""
    start, first, chunks = time.perf_counter(), None, 0
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": tokens, "stream": True}
    try:
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=300) as response:
            if response.status_code != 200:
                return 0.0, 0.0, 0, f"HTTP {response.status_code}"
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return 0.0, 0.0, 0, event["error"]["message"]
                if event["choices"][0]["delta"].get("content"):
                    first = first or time.perf_counter()
                    chunks += 1
    except httpx.HTTPError as exc:
        return 0.0, 0.0, 0, repr(exc)
    end = time.perf_counter()
    return (first or end) - start, end - start, chunks, None


def one_completion(base: str, question: str, tokens: int) -> tuple[float, int, str | None]:
    """(latency, batch size, error) of one non-streaming chat completion."""
    start = time.perf_counter()
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": tokens}
    try:
        response = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=300)
    except httpx.HTTPError as exc:
        return 0.0, 0, repr(exc)
    if response.status_code != 200:
        return 0.0, 0, f"HTTP {response.status_code}"
    return time.perf_counter() - start, response.json()["ragkv"]["stats"]["batch_size"], None


def serve(store: Path, max_queue: int, max_batch: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", "import cli; cli.main()", "serve", "--store", str(store),
                               "--port", str(port), "--max-queue", str(max_queue), "--max-batch", str(max_batch)],
                              cwd=ROOT, stderr=subprocess.DEVNULL, env={**os.environ})
    base = f"http://127.0.0.1:{port}"
    for _ in range(240):
        try:
            httpx.get(f"{base}/healthz")
            break
        except httpx.TransportError:
            time.sleep(0.25)
    one_request(base, QUESTIONS[0], 2)  # warm
    return server, base


def run_level(clients: int, questions: list[str], call) -> tuple[list, float]:
    """`call(question)` for every question from `clients` threads: (results, wall seconds)."""
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(call, questions))
    return results, time.perf_counter() - start


def streaming_rows(base: str, levels: list[int], requests: int, tokens: int) -> list[dict]:
    rows = []
    for clients in levels:
        questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(requests)]
        results, wall = run_level(clients, questions, lambda q: one_request(base, q, tokens))
        ok = [r for r in results if r[3] is None]
        ttfts = [r[0] for r in ok]
        rows.append({"clients": clients, "requests": len(results), "errors": len(results) - len(ok),
                     "rps": len(ok) / wall, "tps": sum(r[2] for r in ok) / wall,
                     "p50": np.percentile(ttfts, 50), "p99": np.percentile(ttfts, 99),
                     "latency": statistics.median(r[1] for r in ok)})
        print(f"streaming, {clients} clients: {rows[-1]}", file=sys.stderr)
    return rows


def popular_rows(base: str, levels: list[int], requests: int, tokens: int) -> list[dict]:
    """Non-streaming clients asking a few popular questions (FAQ-like traffic)."""
    rows = []
    for clients in levels:
        questions = [QUESTIONS[i % POPULAR] for i in range(requests)]
        results, wall = run_level(clients, questions, lambda q: one_completion(base, q, tokens))
        ok = [r for r in results if r[2] is None]
        latencies = [r[0] for r in ok]
        rows.append({"clients": clients, "requests": len(results), "errors": len(results) - len(ok),
                     "rps": len(ok) / wall, "p50": np.percentile(latencies, 50), "p99": np.percentile(latencies, 99),
                     "batch": statistics.mean(r[1] for r in ok)})
        print(f"popular, {clients} clients: {rows[-1]}", file=sys.stderr)
    return rows


POPULAR = 3  # distinct questions in the non-streaming scenario


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="1,4,8")
    parser.add_argument("--requests", type=int, default=24, help="requests per concurrency level")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "serve_load.md")
    args = parser.parse_args()
    levels = [int(n) for n in args.clients.split(",")]
    popular: dict[int, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "store"
        subprocess.run([sys.executable, "-c", "import cli; cli.main()", "ingest", str(ROOT / "data"), "--store",
                        str(store), "--quiet"], cwd=ROOT, check=True, capture_output=True)
        for max_batch in (1, 8):
            server, base = serve(store, max(levels) * 2, max_batch)
            try:
                if max_batch == 8:
                    rows = streaming_rows(base, levels, args.requests, args.tokens)
                popular[max_batch] = popular_rows(base, levels, args.requests, args.tokens)
            finally:
                server.terminate()
                server.wait(timeout=30)
    lines = [
        "# `ragkv serve` under load",
        "",
        f"Bundled SmolLM2-135M-Instruct (float32, CPU: {describe()}) over the sample "
        f"corpus, {args.tokens} new tokens, {args.requests} requests per level; clients and server on one machine "
        "(they share its cores). Model work runs on one worker thread. Command: `python benchmarks/serve_load.py`.",
        "",
        "## Streaming, questions from benchmarks/questions.txt",
        "",
        "Streamed requests run one at a time, so throughput is one model's and TTFT under concurrency is queueing.",
        "",
        "| concurrent clients | requests | errors | requests/s | streamed chunks/s | TTFT p50 s | TTFT p99 s | "
        "latency p50 s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['clients']} | {r['requests']} | {r['errors']} | {r['rps']:.2f} | {r['tps']:.1f} | "
                     f"{r['p50']:.3f} | {r['p99']:.3f} | {r['latency']:.2f} |")
    lines += [
        "",
        f"## Non-streaming, {POPULAR} popular questions: waiting questions batched (`--max-batch 8`) or not (`1`)",
        "",
        "Questions that wait together are grouped by the context they retrieve; each group's KV is loaded once",
        "and its questions are prefilled and decoded as one batch (mean batch: questions decoded together).",
        "Speed-up: requests/s against `--max-batch 1` at the same concurrency.",
        "",
        "| concurrent clients | max batch | requests | errors | requests/s | latency p50 s | latency p99 s | "
        "mean batch | speed-up |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for one, many in zip(popular[1], popular[8]):
        for max_batch, r in ((1, one), (8, many)):
            lines.append(f"| {r['clients']} | {max_batch} | {r['requests']} | {r['errors']} | {r['rps']:.2f} | "
                         f"{r['p50']:.2f} | {r['p99']:.2f} | {r['batch']:.1f} | "
                         f"{r['rps'] / one['rps']:.2f}x |")
    lines += ["", "A batch forms only among questions waiting at the same moment that retrieve the same context; "
              "decoding questions of different contexts in one batch is the next lever."]
    args.out.write_text("\n".join(lines) + "\n")
    print(args.out.read_text())


if __name__ == "__main__":
    main()
