"""Time to first token against document length, side by side in one run, and what bounds it.

For the bundled SmolLM2-135M and a random-weight model of Qwen2.5-0.5B's shape, in bfloat16
and float32, at documents of 256..4096 tokens (one chunk each), medians of --repeats
interleaved runs (spread in parentheses), all warm, retrieval excluded (reported beside):
- full: a full prefill of the prompt;
- cached: ragkv's path from the store (catalog lookup, shard read + checksum, cache
  assembly, question prefill, first token), RAM tier off;
- RAM tier: the same with the chunk KV already in the engine's RAM tier;
- oracle: the question-only prefill over KV already in memory as a ready cache (the bound).
Also: ingest KV tokens/s vs the bare forward over the same chunks, stored bytes vs raw KV
bytes, and retrieval p50/p99 (question embedding + FAISS search) at 10k and 100k chunks.

    python benchmarks/ttft.py [--repeats 3] [--models smollm2,qwen0.5b] [--max-length 4096]
"""

from __future__ import annotations

import argparse
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import faiss
import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from transformers import AutoTokenizer  # noqa: E402

import ragkv  # noqa: E402
from benchmarks.machine import describe  # noqa: E402
from ragkv.core.config import AskSettings, IngestSettings, ModelSettings, cache_dir  # noqa: E402
from ragkv.core.lru import ByteLRU  # noqa: E402
from ragkv.kv import cache as kv  # noqa: E402
from ragkv.model.forward import compute_chunks, compute_prefix  # noqa: E402
from ragkv.model.generate import prefill  # noqa: E402
from ragkv.model.llm import resolve_model_path  # noqa: E402
from ragkv.model.prompt import encode_text  # noqa: E402
from ragkv.store.stats import store_stats  # noqa: E402

LENGTHS = (256, 512, 1024, 2048, 4096)
QUESTION = (
    "Which of the facts listed in this section mentions the valve that opens first, and what happens after it opens?"
)
WORDS = (
    "valve pump sensor relay gauge filter boiler turbine compressor regulator manifold actuator "
    "opens closes rises falls holds drains vents locks trips resets"
).split()


def qwen_shape_model() -> Path:
    """A random-weight model with Qwen2.5-0.5B's shape (24 layers, 896 hidden, 14 heads, 2 KV
    heads, 151,936 vocab), built once into the cache, with SmolLM2's tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    folder = cache_dir() / "bench" / "qwen2.5-0.5b-shape"
    if (folder / "config.json").is_file():
        return folder
    config = Qwen2Config(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=32768,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        use_sliding_window=False,
    )
    torch.manual_seed(0)
    return save_with_tokenizer(Qwen2ForCausalLM(config).to(torch.bfloat16), folder)


def save_with_tokenizer(model, folder: Path) -> Path:
    """`model` saved into `folder` with SmolLM2's tokenizer and chat template, whole or not at all
    (written beside it, then renamed)."""
    from ragkv.model.llm import bundled_smollm2_path

    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(bundled_smollm2_path() / name, tmp / name)
    tmp.rename(folder)
    return folder


def write_documents(folder: Path, tokenizer, lengths) -> dict[int, str]:
    """One document of about each length (in tokens), as `length -> doc id`."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    docs = {}
    for length in lengths:
        sentences, text = [], ""
        while len(encode_text(tokenizer, text)) < length - 12:
            w = rng.choice(WORDS, 4)
            sentences.append(f"Fact {len(sentences)}: the {w[0]} {w[2]} after the {w[1]} {w[3]}.")
            text = " ".join(sentences)
        name = f"doc-{length}.txt"
        (folder / name).write_text(text)
        docs[length] = name
    return docs


def median_spread(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def oracle_s(engine, doc: str) -> float:
    """Question-only prefill and first token over the same KV, already a ready cache."""
    answer = engine.ask(QUESTION, doc_ids=[doc], max_new_tokens=1)
    live = answer.prompt_ids[answer.stats.reused_tokens :]
    rows = [row for row, _ in engine.retrieve(QUESTION, 1, doc_ids=[doc])]
    cache = engine.assemble(rows, AskSettings()).cache
    held = kv.num_cached(cache)
    start = time.perf_counter()
    int(prefill(engine.lm.model, live, cache).argmax())
    elapsed = time.perf_counter() - start
    kv.crop(cache, held)
    return elapsed


def measure(engine, docs: dict[int, str], repeats: int) -> list[dict]:
    rows = []
    store_tier, ram_tier = ByteLRU(0), ByteLRU(4 << 30)
    for length, doc in docs.items():
        samples = {"full": [], "cached": [], "ram": [], "oracle": []}
        parts = {"catalog_ms": [], "kv_read_ms": [], "assemble_ms": [], "prefill_ms": [], "retrieval_ms": []}
        engine.ram = ram_tier
        engine.ask(QUESTION, doc_ids=[doc], max_new_tokens=1)  # warm: pages, kernels, RAM tier
        for _ in range(repeats):
            full = engine.ask(QUESTION, doc_ids=[doc], max_new_tokens=1, use_cache=False).stats
            samples["full"].append(full.ttft_s - full.retrieval_ms / 1000)
            engine.ram = store_tier
            cached = engine.ask(QUESTION, doc_ids=[doc], max_new_tokens=1).stats
            samples["cached"].append(cached.ttft_s - cached.retrieval_ms / 1000)
            for key in parts:
                parts[key].append(getattr(cached, key))
            engine.ram = ram_tier
            ram = engine.ask(QUESTION, doc_ids=[doc], max_new_tokens=1).stats
            assert ram.ram_hits == 1
            samples["ram"].append(ram.ttft_s - ram.retrieval_ms / 1000)
            samples["oracle"].append(oracle_s(engine, doc))
        rows.append(
            {
                "length": cached.reused_tokens + cached.computed_tokens,
                "doc_tokens": length,
                **{k: median_spread(v) for k, v in samples.items()},
                **{k: statistics.median(v) for k, v in parts.items()},
            }
        )
        print(
            f"  {length} tokens: full {rows[-1]['full'][0]:.3f} s, cached {rows[-1]['cached'][0]:.3f} s, "
            f"oracle {rows[-1]['oracle'][0]:.3f} s",
            file=sys.stderr,
        )
    return rows


def ingest_vs_bare(engine, docs_dir: Path, settings: IngestSettings) -> float:
    """Bare forward tokens/s over the same chunks as the ingest (the ingest's limit)."""
    from ragkv.pipelines.reading.chunk import chunk_text
    from ragkv.pipelines.reading.read import read_documents

    lm, layout = engine.lm, engine.active.layout
    chunks = [
        encode_text(lm.tokenizer, c)
        for d in read_documents([docs_dir]).documents
        for c in chunk_text(d.text, lm.tokenizer, settings.chunk_tokens)
    ]
    start = time.perf_counter()
    prefix = compute_prefix(lm.model, layout.prefix_ids)
    for _ in compute_chunks(lm.model, prefix, chunks, settings.batch_tokens_for("cpu"), lm.pad_id):
        pass
    return sum(map(len, chunks)) / (time.perf_counter() - start)


def retrieval_latency(engine, sizes=(10_000, 100_000), queries: int = 200) -> list[dict]:
    """p50/p99 of question embedding and of a flat FAISS search over `size` synthetic vectors."""
    from ragkv.store.index.vectors import VectorIndex

    rng = np.random.default_rng(0)
    questions = [f"{QUESTION} (variant {i})" for i in range(queries)]
    embed_ms = []
    for q in questions:
        start = time.perf_counter()
        engine.embedder.embed_queries([q])
        embed_ms.append((time.perf_counter() - start) * 1000)
    rows = []
    for size in sizes:
        index = VectorIndex.empty(engine.embedder.dim)
        vectors = rng.standard_normal((size, engine.embedder.dim)).astype(np.float32)
        index.add(list(range(size)), vectors / np.linalg.norm(vectors, axis=1, keepdims=True))
        query_vectors = engine.embedder.embed_queries(questions[:queries])
        search_ms = []
        for vector in query_vectors:
            start = time.perf_counter()
            index.search(vector, 5)
            search_ms.append((time.perf_counter() - start) * 1000)
        total = [e + s for e, s in zip(embed_ms, search_ms, strict=False)]
        rows.append(
            {
                "size": size,
                "embed": np.percentile(embed_ms, [50, 99]),
                "search": np.percentile(search_ms, [50, 99]),
                "total": np.percentile(total, [50, 99]),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", default="smollm2,qwen0.5b")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--max-length", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "ttft.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    models = {
        "smollm2": ("SmolLM2-135M (bundled)", "smollm2"),
        "qwen0.5b": ("Qwen2.5-0.5B shape (random weights)", None),
    }
    lengths = [n for n in LENGTHS if n <= args.max_length]
    settings = IngestSettings(chunk_tokens=args.max_length + 64)
    results, retrieval = [], None
    with tempfile.TemporaryDirectory() as tmp:
        for key in args.models.split(","):
            label, name = models[key]
            name = name or str(qwen_shape_model())
            for dtype in args.dtypes.split(","):
                print(f"{label} {dtype}", file=sys.stderr)
                store = Path(tmp) / f"{key}-{dtype}"
                docs = write_documents(
                    Path(tmp) / f"docs-{key}", AutoTokenizer.from_pretrained(resolve_model_path(name)), lengths
                )
                report = ragkv.ingest(
                    [Path(tmp) / f"docs-{key}"],
                    store,
                    model=ModelSettings(model=name, device="cpu", dtype=dtype),
                    settings=settings,
                )
                with ragkv.open(store, device="cpu") as engine:
                    bare = ingest_vs_bare(engine, Path(tmp) / f"docs-{key}", settings)
                    rows = measure(engine, docs, args.repeats)
                    if retrieval is None:
                        retrieval = retrieval_latency(engine)
                    snapshot_stats = store_stats(engine.snapshot)
                facts = engine.lm.facts
                results.append(
                    {
                        "model": label,
                        "dtype": dtype,
                        "rows": rows,
                        "ingest": report.tokens_per_s,
                        "bare": bare,
                        "disk": snapshot_stats["shard_bytes"],
                        "raw": snapshot_stats["live_bytes"],
                        "bytes_per_token": facts.kv_bytes_per_token,
                    }
                )
    args.out.write_text(render(results, retrieval, args))
    plot(results, args.out.with_suffix(".png"))
    print(args.out.read_text())


def render(results, retrieval, args) -> str:
    lines = [
        "# Time to first token vs document length",
        "",
        f"CPU: {describe()}, {torch.get_num_threads()} torch threads, sdpa attention, inference_mode; "
        f"torch {torch.__version__}, python {platform.python_version()}. Median of {args.repeats} interleaved "
        "warm runs (min-max). Retrieval excluded from every column and reported below. "
        "Command: `python benchmarks/ttft.py`. Plot: `ttft.png`.",
        "",
        "Columns: *full* = full prefill of the prompt; *cached* = ragkv from the store (catalog, shard read "
        "+ checksum, cache assembly, question prefill, first token; RAM tier off); *RAM tier* = the same with "
        "the chunk KV already in the engine's RAM tier; *oracle* = question-only prefill over the same KV "
        "already in memory as a ready cache.",
        "",
        "| model | dtype | prompt tokens | full s | cached s | RAM tier s | oracle s | full / cached | cached / oracle | "
        "RAM tier / oracle | cached: catalog / KV read / assemble / prefill ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    fmt = lambda v: f"{v[0]:.3f} ({v[1]:.3f}-{v[2]:.3f})"  # noqa: E731
    for result in results:
        for r in result["rows"]:
            lines.append(
                f"| {result['model']} | {result['dtype']} | {r['length']} | {fmt(r['full'])} | {fmt(r['cached'])} | "
                f"{fmt(r['ram'])} | {fmt(r['oracle'])} | {r['full'][0] / r['cached'][0]:.1f}× | "
                f"{r['cached'][0] / r['oracle'][0]:.2f} | {r['ram'][0] / r['oracle'][0]:.2f} | "
                f"{r['catalog_ms']:.1f} / {r['kv_read_ms']:.1f} / {r['assemble_ms']:.1f} / {r['prefill_ms']:.0f} |"
            )
    lines += [
        "",
        "## Ingest throughput and storage",
        "",
        "| model | dtype | ingest KV tokens/s | bare forward tokens/s | ingest / bare | bytes on disk / raw KV bytes |",
        "|---|---|---|---|---|---|",
    ]
    for result in results:
        lines.append(
            f"| {result['model']} | {result['dtype']} | {result['ingest']:,.0f} | {result['bare']:,.0f} | "
            f"{result['ingest'] / result['bare']:.2f} | {result['disk'] / result['raw']:.4f} |"
        )
    lines += ["", "## Targets", "", "| target | measured | met |", "|---|---|---|"]
    for result in results:
        worst = max(
            (r for r in result["rows"] if r["doc_tokens"] >= 512), key=lambda r: r["cached"][0] / r["oracle"][0]
        )
        ratio = worst["cached"][0] / worst["oracle"][0]
        ram = max(r["ram"][0] / r["oracle"][0] for r in result["rows"] if r["doc_tokens"] >= 512)
        lines.append(
            f"| cached ≤ 1.15 × oracle, ≥ 512 tokens ({result['model']}, {result['dtype']}) | worst {ratio:.2f} "
            f"at {worst['length']} tokens (RAM tier worst {ram:.2f}) | {'yes' if ratio <= 1.15 else 'no'} |"
        )
    worst_ingest = min(r["ingest"] / r["bare"] for r in results)
    worst_disk = max(r["disk"] / r["raw"] for r in results)
    lines.append(
        f"| ingest ≥ 0.9 × bare forward | worst {worst_ingest:.2f} | {'yes' if worst_ingest >= 0.9 else 'no'} |"
    )
    lines.append(f"| stored bytes ≤ 1.02 × raw KV | worst {worst_disk:.4f} | {'yes' if worst_disk <= 1.02 else 'no'} |")
    if retrieval:
        p50 = max(r["total"][0] for r in retrieval)
        lines.append(
            f"| retrieval p50 ≤ 25 ms | {p50:.1f} ms at {retrieval[-1]['size']:,} chunks | {'yes' if p50 <= 25 else 'no'} |"
        )
    lines += [
        "",
        "## Retrieval (question embedding with all-MiniLM-L6-v2 + FAISS flat search, 1 query at a time)",
        "",
        f"FAISS threads: {faiss.omp_get_max_threads()}.",
        "",
        "| chunks | embed p50 / p99 ms | search p50 / p99 ms | total p50 / p99 ms |",
        "|---|---|---|---|",
    ]
    for r in retrieval or []:
        lines.append(
            f"| {r['size']:,} | {r['embed'][0]:.1f} / {r['embed'][1]:.1f} | {r['search'][0]:.1f} / "
            f"{r['search'][1]:.1f} | {r['total'][0]:.1f} / {r['total'][1]:.1f} |"
        )
    return "\n".join(lines) + "\n"


def plot(results, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return
    models = sorted({r["model"] for r in results})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models, strict=False):
        for result in (r for r in results if r["model"] == model):
            style = "-" if result["dtype"] == "bfloat16" else "--"
            x = [r["length"] for r in result["rows"]]
            for column, color in (("full", "tab:red"), ("cached", "tab:blue"), ("oracle", "tab:green")):
                ax.plot(
                    x,
                    [r[column][0] for r in result["rows"]],
                    style,
                    color=color,
                    marker="o",
                    label=f"{column} ({result['dtype']})",
                )
        ax.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="time to first token (s)", title=model)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
