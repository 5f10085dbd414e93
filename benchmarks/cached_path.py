"""Where the cached path's time goes against the oracle, at 2k and 4k tokens (float32, the bundled
SmolLM2-135M), before and after the two changes that took it to the oracle:

- *read*: `buffer + copy` read a stored entry into a reused buffer, then copied it into the
  cache; `direct` reads it from the shard straight into the cache's layers (codec.StoredKV);
- *allocator*: `glibc default` hands freed blocks back to the kernel, so every answer's new
  cache is fresh memory, faulted in 4 KiB at a time; `kept` is `ragkv.cpu.keep_freed_memory`,
  which a process turns on when it loads a model onto the CPU.

Each variant runs in its own process (the allocator setting is per process), every variant
twice, round robin. In each: *cached* = `engine.ask` from the store with the RAM tier off (the
catalog, the read and checksum, the cache, the question's prefill, the first token), *oracle* =
the question's prefill and first token over the same KV already in memory as a ready cache
(as `ttft.py`). Their ratio is measured in one process, side by side.

    python benchmarks/cached_path.py            # writes benchmarks/results/cached_path.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.machine import describe  # noqa: E402
from benchmarks.ttft import QUESTION, oracle_s, write_documents  # noqa: E402

VARIANTS = (
    ("glibc default", "buffer + copy"),
    ("glibc default", "direct"),
    ("kept", "buffer + copy"),
    ("kept", "direct"),
)
LENGTHS = (2048, 4096)
PARTS = ("kv_read_ms", "assemble_ms", "prefill_ms")


def measure_variant(store: Path, docs: dict[int, str], allocator: str, read: str, repeats: int) -> list[dict]:
    """In this process: the variant's cached and oracle times per document length."""
    import ragkv
    import ragkv.codec
    import ragkv.model
    from ragkv.lru import ByteLRU

    if allocator == "glibc default":
        ragkv.model.keep_freed_memory = lambda: False  # type: ignore[attr-defined]
    if read == "buffer + copy":
        ragkv.codec.deferred = lambda *args, **kwargs: None  # type: ignore[assignment]
    rows = []
    with ragkv.open(store, device="cpu") as engine:
        engine.ram = ByteLRU(0)
        for length, doc in docs.items():
            engine.ask(QUESTION, doc_ids=[doc], max_new_tokens=1)  # warm: pages, kernels
            cached, oracle, parts = [], [], {name: [] for name in PARTS}
            for _ in range(repeats):
                stats = engine.ask(QUESTION, doc_ids=[doc], max_new_tokens=1).stats
                cached.append(stats.ttft_s - stats.retrieval_ms / 1000)
                for name in PARTS:
                    parts[name].append(getattr(stats, name))
                oracle.append(oracle_s(engine, doc))
            rows.append(
                {
                    "length": length,
                    "tokens": stats.reused_tokens + stats.computed_tokens,
                    "cached": cached,
                    "oracle": oracle,
                    **{name: statistics.median(values) for name, values in parts.items()},
                }
            )
    return rows


def build(folder: Path) -> tuple[Path, dict[int, str]]:
    import ragkv
    from ragkv.config import IngestSettings, ModelSettings

    model = ModelSettings(model="smollm2", device="cpu", dtype="float32")
    from transformers import AutoTokenizer

    from ragkv.model import resolve_model_path

    docs = write_documents(folder / "docs", AutoTokenizer.from_pretrained(resolve_model_path("smollm2")), LENGTHS)
    ragkv.ingest([folder / "docs"], folder / "store", model=model, settings=IngestSettings(chunk_tokens=4160))
    return folder / "store", docs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cached_path.md")
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # "allocator|read|store|docs json": one child run
    args = parser.parse_args()
    if args.variant:
        allocator, read, store, docs = args.variant.split("|", 3)
        found = {int(k): v for k, v in json.loads(docs).items()}
        print(json.dumps(measure_variant(Path(store), found, allocator, read, args.repeats)))
        return
    results: dict[tuple[str, str], list[list[dict]]] = {variant: [] for variant in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        store, docs = build(Path(tmp))
        for round_ in range(args.rounds):
            for allocator, read in VARIANTS:
                print(f"round {round_ + 1}: {allocator}, {read}", file=sys.stderr)
                spec = "|".join((allocator, read, str(store), json.dumps(docs)))
                child = [sys.executable, __file__, "--variant", spec, "--repeats", str(args.repeats)]
                done = subprocess.run(child, capture_output=True, text=True, check=True)
                results[(allocator, read)].append(json.loads(done.stdout.splitlines()[-1]))
    args.out.write_text(render(results, args))
    print(args.out.read_text())


def render(results: dict[tuple[str, str], list[list[dict]]], args) -> str:
    lines = [
        "# The cached path against the oracle (float32, SmolLM2-135M)",
        "",
        f"CPU: {describe()}, {torch.get_num_threads()} torch threads; torch {torch.__version__}. Each variant in "
        f"its own process, {args.rounds} rounds round robin, {args.repeats} warm runs each: medians over all "
        "of them. RAM tier off. Command: `python benchmarks/cached_path.py`.",
        "",
        "| allocator | read | prompt tokens | cached s | oracle s | cached / oracle | read / assemble / prefill ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for (allocator, read), runs in results.items():
        for i, length in enumerate(LENGTHS):
            rows = [run[i] for run in runs]
            cached = statistics.median(v for row in rows for v in row["cached"])
            oracle = statistics.median(v for row in rows for v in row["oracle"])
            parts = " / ".join(f"{statistics.median(row[name] for row in rows):.1f}" for name in PARTS)
            lines.append(
                f"| {allocator} | {read} | {rows[0]['tokens']} ({length}) | {cached:.3f} | {oracle:.3f} | "
                f"{cached / oracle:.2f} | {parts} |"
            )
    lines += [
        "",
        "*read*: the shard read and its checksum (for `direct`, into the cache itself); *assemble*: "
        "building the cache (for `buffer + copy`, the copy); *prefill*: the question's prefill and first "
        "token. The oracle pays neither the read nor the cache's memory: its cache is built, and its pages "
        "touched, before its clock starts.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
