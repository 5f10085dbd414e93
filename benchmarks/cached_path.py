"""Where the cached path's time goes against the oracle, at 2k and 4k tokens (float32, the bundled
SmolLM2-135M), before and after the two changes that took it to the oracle:

- *read*: `buffer + copy` read a stored entry into a reused buffer, then copied it into the
  cache; `direct` reads it from the shard straight into the cache's layers (codec.StoredKV);
- *read*, `direct, layer by layer behind the prefill` (a prototype, here only): the same direct
  read, in a thread, one layer at a time, while the question's prefill runs; the prefill's layer
  i waits for layer i's bytes only. It asks whether the read can be hidden behind the prefill.
- *allocator*: `glibc default` hands freed blocks back to the kernel, so every answer's new
  cache is fresh memory, faulted in 4 KiB at a time; `kept` is `ragkv.core.cpu.keep_freed_memory`,
  which a process turns on when it loads a model onto the CPU.

Each variant runs in its own process (the allocator setting is per process), every variant
three times, round robin. In each: *cached* = `engine.ask` from the store with the RAM tier off (the
catalog, the read and checksum, the cache, the question's prefill, the first token), *oracle* =
the question's prefill and first token over the same KV already in memory as a ready cache
(as `ttft.py`). Their ratio is measured in one process, side by side.

    python benchmarks/cached_path.py            # writes benchmarks/results/cached_path.md
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch
import xxhash

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.machine import describe  # noqa: E402
from benchmarks.ttft import QUESTION, oracle_s, write_documents  # noqa: E402

VARIANTS = (
    ("glibc default", "buffer + copy"),
    ("glibc default", "direct"),
    ("kept", "buffer + copy"),
    ("kept", "direct"),
    ("kept", LAYERED := "direct, layer by layer behind the prefill"),
)
LENGTHS = (2048, 4096)
PARTS = ("kv_read_ms", "assemble_ms", "prefill_ms")


def measure_variant(store: Path, docs: dict[int, str], allocator: str, read: str, repeats: int) -> list[dict]:
    """In this process: the variant's cached and oracle times per document length."""
    import ragkv
    import ragkv.kv.codec
    import ragkv.model.llm
    from ragkv.core.lru import ByteLRU

    if allocator == "glibc default":
        ragkv.model.llm.keep_freed_memory = lambda: False  # type: ignore[attr-defined]
    if read == "buffer + copy":
        ragkv.kv.codec.deferred = lambda *args, **kwargs: None  # type: ignore[assignment]
    layered = LayeredRead() if read == LAYERED else None
    rows = []
    with ragkv.open(store, device="cpu") as engine:
        engine.ram = ByteLRU(0)
        for length, doc in docs.items():
            engine.ask(QUESTION, doc_ids=[doc], max_new_tokens=1)  # warm: pages, kernels
            cached, oracle, parts, answers = [], [], {name: [] for name in PARTS}, set[str]()
            for _ in range(repeats):
                with layered or contextlib.nullcontext():
                    answer = engine.ask(QUESTION, doc_ids=[doc], max_new_tokens=1)
                stats = answer.stats
                answers.add(answer.text)
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
                    "answers": sorted(answers),
                    **{name: statistics.median(values) for name, values in parts.items()},
                }
            )
    return rows


class LayeredRead:
    """Within `with`: a deferred entry (codec.StoredKV) is read by a thread, one layer at a time,
    into the cache, and the cache's layer i waits for layer i's bytes when the prefill first uses
    it; on leaving, the thread is joined and the entry's checksum checked. A prototype to measure,
    on the store's private reader: a shipped form would also need the fall back to a full prefill
    when the checksum fails after the prefill began."""

    def __init__(self):
        from transformers import DynamicCache

        import ragkv.kv.codec

        self.events: list[threading.Event] = []
        self.thread: threading.Thread | None = None
        self.ok = True
        direct, update = ragkv.kv.codec.StoredKV.fill, DynamicCache.update
        outer = self

        def fill(part, layers, start):
            if not outer.active:
                return direct(part, layers, start)
            outer.start(part, layers, start)

        def waiting_update(cache, key_states, value_states, layer_idx, *args, **kwargs):
            if outer.events:
                outer.events[layer_idx].wait()
            return update(cache, key_states, value_states, layer_idx, *args, **kwargs)

        self.active = False
        ragkv.kv.codec.StoredKV.fill = fill  # type: ignore[method-assign]
        DynamicCache.update = waiting_update  # type: ignore[method-assign]

    def start(self, part, layers, start: int) -> None:
        shards, entry = part.shards, part.entry
        opened, names = shards._entry(entry.shard, entry.tensor)
        _, _, begin, end = names[""]
        per_layer = (end - begin) // len(layers)
        self.events = [threading.Event() for _ in layers]

        def run() -> None:
            digest, self.ok = xxhash.xxh3_64(), False
            try:
                for i, layer in enumerate(layers):
                    targets = part.targets(layer, start)
                    low = begin + i * per_layer
                    shards._read_verbatim(entry.shard, entry.tensor, opened, targets, low, low + per_layer, digest)
                    self.events[i].set()
                self.ok = digest.hexdigest() == entry.checksum
            finally:  # a failed read must not leave the prefill waiting
                for event in self.events:
                    event.set()

        part.read_ms = 0.0
        self.thread = threading.Thread(target=run)
        self.thread.start()

    def __enter__(self):
        self.active = True
        return self

    def __exit__(self, *exc) -> None:
        self.active = False
        if self.thread is not None:
            self.thread.join()
            assert self.ok, "the entry read layer by layer fails its checksum"
        self.thread, self.events = None, []


def build(folder: Path) -> tuple[Path, dict[int, str]]:
    import ragkv
    from ragkv.core.config import IngestSettings, ModelSettings

    model = ModelSettings(model="smollm2", device="cpu", dtype="float32")
    from transformers import AutoTokenizer

    from ragkv.model.llm import resolve_model_path

    docs = write_documents(folder / "docs", AutoTokenizer.from_pretrained(resolve_model_path("smollm2")), LENGTHS)
    ragkv.ingest([folder / "docs"], folder / "store", model=model, settings=IngestSettings(chunk_tokens=4160))
    return folder / "store", docs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
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
        "touched, before its clock starts. For the layer-by-layer read, *read* is ~0: the read runs inside "
        "*prefill*.",
        "",
        f"First token, every variant and run: {_agreement(results)}.",
    ]
    return "\n".join(lines) + "\n"


def _agreement(results: dict[tuple[str, str], list[list[dict]]]) -> str:
    """Whether every variant answered the same first token at each length."""
    found = []
    for i, length in enumerate(LENGTHS):
        answers = {text for runs in results.values() for run in runs for text in run[i]["answers"]}
        found.append(
            f"{length} tokens: "
            + (f"the same ({next(iter(answers))!r})" if len(answers) == 1 else f"differs {sorted(answers)}")
        )
    return "; ".join(found)


if __name__ == "__main__":
    main()
