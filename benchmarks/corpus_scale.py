"""Corpus scale: a KV budget of 10% against every chunk's KV precomputed and against none, on
over 500k tokens of the Python 3.11 library reference (Debian's python3.11-doc), with 2,000+
questions whose chunks follow Zipf(1.1), replayed in order. All three in one run.

    python benchmarks/corpus_scale.py [--work DIR] [--tokens 520000] [--questions 2000]

Per store: ingest time, bytes on disk, hit rate over time, mean and p90 TTFT; then the
eviction policy replayed offline on the same trace (LRU, LFU, ragkv's LFU with ageing) at the
same budget, with popularity fixed and after it moves. Writes corpus_scale.md and .png.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import time
from collections import Counter, OrderedDict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import ragkv  # noqa: E402
from benchmarks.fidelity import python_faq_or_exit, work_dir  # noqa: E402
from benchmarks.machine import describe  # noqa: E402
from ragkv.core.config import IngestSettings, ModelSettings  # noqa: E402
from ragkv.model.llm import load_model  # noqa: E402
from ragkv.pipelines.reading.read import read_documents  # noqa: E402
from ragkv.store import open_snapshot  # noqa: E402
from ragkv.store.kv.budget import Candidate, plan  # noqa: E402
from ragkv.store.kv.popularity import ChunkHits, Use  # noqa: E402
from ragkv.store.kv.shards import shard_files  # noqa: E402

CHUNK_TOKENS = 256
BUDGET_SHARE = 0.10
ZIPF_S = 1.1
WINDOW = 100  # questions per point of the hit-rate curve


def corpus(work: Path, target_tokens: int, tokenizer, page_tokens: tuple[int, int] | None = None) -> tuple[Path, int]:
    """Library-reference pages, in name order, until their text holds `target_tokens` (only
    pages of `page_tokens` (fewest, most) tokens, when given)."""
    python_faq_or_exit(work, 1)  # fetches and unpacks python3.11-doc
    html = work / "pyfaq" / "usr" / "share" / "doc" / "python3.11" / "html" / "library"
    sized = f"-{page_tokens[0]}-{page_tokens[1]}" if page_tokens else ""
    docs = work / f"pylib{sized}-{target_tokens}"
    if docs.exists():
        shutil.rmtree(docs)
    docs.mkdir()
    total = 0
    for page in sorted(html.glob("*.html")):
        (doc,) = read_documents([page]).documents or (None,)
        if doc is None:
            continue
        tokens = len(tokenizer(doc.text, add_special_tokens=False)["input_ids"])
        if page_tokens is None or page_tokens[0] <= tokens <= page_tokens[1]:
            shutil.copy(page, docs / page.name)
            total += tokens
        if total >= target_tokens:
            break
    return docs, total


def draw(chunk_ids: list[int], count: int, seed: int) -> list[int]:
    """`count` chunks drawn by Zipf(1.1) over `chunk_ids` in a random order (so popularity is
    unrelated to document order)."""
    rng = random.Random(seed)
    ranked = chunk_ids[:]
    rng.shuffle(ranked)
    return rng.choices(ranked, weights=[1.0 / (k + 1) ** ZIPF_S for k in range(len(ranked))], k=count)


def questions_for(store: Path, count: int, seed: int) -> tuple[list[str], list[int]]:
    """`count` questions, each the opening words of a chunk `draw` picks, and the chunk ids."""
    with open_snapshot(store) as snapshot:
        texts = dict(snapshot.catalog.con.execute("SELECT chunk_id, text FROM chunks ORDER BY chunk_id").fetchall())
    drawn = draw(sorted(texts), count, seed)
    return [" ".join(texts[c].split()[:16]) for c in drawn], drawn


def ingest(docs: Path, store: Path, **settings) -> float:
    started = time.perf_counter()
    ragkv.ingest(
        [docs],
        store,
        model=ModelSettings(device="cpu", dtype="float32"),
        settings=IngestSettings(chunk_tokens=CHUNK_TOKENS, **settings),
    )
    return time.perf_counter() - started


def disk_bytes(store: Path) -> int:
    return sum(shard_files(store / "shards").values()) + sum(p.stat().st_size for p in store.glob("*.duckdb"))


def replay(store: Path, questions: list[str], keep_kv: bool) -> list[dict]:
    """Ask every question in order (first token only); per question its TTFT, where its chunk
    KV came from and the chunk it used. No RAM tier: hits are the store's. Without `keep_kv`,
    no write-back either."""
    out = []
    with ragkv.open(store, device="cpu", write_back=keep_kv, ram_bytes=0) as engine:
        for i, question in enumerate(questions):
            engine.refresh()  # as the service does between requests: see what the write-back stored
            answer = engine.ask(question, max_new_tokens=1)
            out.append(
                {
                    "ttft": answer.stats.ttft_s,
                    "source": answer.stats.kv_source or "live",
                    "chunk": answer.sources[0].chunk_id,
                }
            )
            if (i + 1) % 200 == 0:
                recent = out[-200:]
                print(
                    f"  {i + 1}: hit rate {hit_rate(recent):.0%}, mean TTFT "
                    f"{statistics.mean(r['ttft'] for r in recent):.3f} s",
                    flush=True,
                )
    return out


def hit_rate(rows: list[dict]) -> float:
    return sum(r["source"] in ("store", "ram") for r in rows) / len(rows)


def p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[-1]


# -- the eviction policy, replayed offline ---------------------------------------------------
def simulate(trace: list[int], sizes: dict[int, int], room: int, policy: str, half_life: float = 0.0) -> float:
    """Hit rate of a chunk KV cache of `room` bytes over `trace` (chunk ids), starting empty,
    storing each miss if the policy admits it. "lru": evict least recent; "lfu": ragkv's
    budget plan with counts that never age; "ragkv": the plan with scores halving every
    `half_life` questions."""
    hits = 0
    if policy == "lru":
        cache: OrderedDict[int, int] = OrderedDict()
        used = 0
        for chunk in trace:
            if chunk in cache:
                hits += 1
                cache.move_to_end(chunk)
                continue
            cache[chunk] = sizes[chunk]
            used += sizes[chunk]
            while used > room:
                used -= cache.popitem(last=False)[1]
        return hits / len(trace)
    stats: dict[int, ChunkHits] = {}
    stored: set[int] = set()
    for t, chunk in enumerate(trace):
        stats.setdefault(chunk, ChunkHits()).add(Use("", 0, "store", float(t)), half_life or float("inf"))
        if chunk in stored:
            hits += 1
            continue

        def score(c: int) -> float:
            s = stats[c]
            return s.score * 0.5 ** ((t - s.last_use) / half_life) if half_life else s.score  # noqa: B023 - used now

        candidates = [Candidate(str(c), sizes[c], score(c), True, c) for c in stored]
        decision = plan(candidates + [Candidate(str(chunk), sizes[chunk], score(chunk), False, chunk)], room)
        stored = {int(k) for k in decision.keep + decision.compute}
    return hits / len(trace)


def shifted(trace: list[int], seed: int) -> list[int]:
    """`trace` with popularity moved halfway: the second half's chunks renamed by a permutation."""
    chunks = sorted(set(trace))
    moved = chunks[:]
    random.Random(seed).shuffle(moved)
    rename = dict(zip(chunks, moved, strict=False))
    half = len(trace) // 2
    return trace[:half] + [rename[c] for c in trace[half:]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=None, help="downloads and stores (reused if given)")
    parser.add_argument("--tokens", type=int, default=520_000, help="corpus size in LLM tokens")
    parser.add_argument("--questions", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "corpus_scale.md")
    args = parser.parse_args()
    work = work_dir(args.work, "corpus-scale")
    tokenizer = load_model("smollm2", "cpu", "float32").tokenizer
    docs, num_tokens = corpus(work, args.tokens, tokenizer)
    print(f"corpus: {len(list(docs.iterdir()))} pages, {num_tokens:,} tokens", flush=True)
    stores = {name: work / f"store-{name}" for name in ("all", "budget", "none")}
    for store in stores.values():
        shutil.rmtree(store, ignore_errors=True)
    ingest_s = {"all": ingest(docs, stores["all"])}
    with open_snapshot(stores["all"]) as snapshot:
        full_bytes = snapshot.catalog.reports.kv_bytes()
        prefix_bytes = snapshot.catalog.reports.prefix_bytes()
        sizes = {
            cid: nbytes
            for cid, nbytes in snapshot.catalog.con.execute(
                "SELECT k.chunk_id, e.nbytes FROM chunk_kv k JOIN kv_entries e USING (kv_key)"
            ).fetchall()
        }
        num_chunks = snapshot.catalog.reports.counts()["chunks"]
    limit = int(full_bytes * BUDGET_SHARE)
    ingest_s["budget"] = ingest(docs, stores["budget"], kv_budget=limit)
    ingest_s["none"] = ingest(docs, stores["none"], precompute=0)
    print(f"ingest s: {ingest_s}; full KV {full_bytes / 1e9:.2f} GB, budget {limit / 1e9:.2f} GB", flush=True)
    questions, targets = questions_for(stores["all"], args.questions, args.seed)
    runs, bytes_after = {}, {}
    for name in ("all", "budget", "none"):
        print(f"replay {name}", flush=True)
        runs[name] = replay(stores[name], questions, keep_kv=name != "none")
        bytes_after[name] = disk_bytes(stores[name])
    started = time.perf_counter()  # the nightly job: re-plan the budget by what was asked
    ingest(docs, stores["budget"])
    ingest_s["budget, day 2"] = time.perf_counter() - started
    day2, _ = questions_for(stores["all"], args.questions, args.seed + 1)  # a new ranking: popularity moved
    print("replay budget, day 2", flush=True)
    runs["budget, day 2"] = replay(stores["budget"], day2, keep_kv=True)
    bytes_after["budget, day 2"] = disk_bytes(stores["budget"])
    live_bytes = {}
    for name, store in stores.items():
        with open_snapshot(store) as snapshot:
            live_bytes[name] = snapshot.catalog.reports.kv_bytes()
    live_bytes["budget, day 2"] = live_bytes["budget"]
    trace = [r["chunk"] for r in runs["all"]]
    room = limit - prefix_bytes
    policies = {}
    for label, events in (("fixed popularity", trace), ("popularity moves halfway", shifted(trace, args.seed))):
        policies[label] = {
            "LRU": simulate(events, sizes, room, "lru"),
            "LFU (no ageing)": simulate(events, sizes, room, "lfu"),
            "ragkv: LFU, half-life 200 questions": simulate(events, sizes, room, "ragkv", 200.0),
        }
    matched = sum(r["chunk"] == t for r, t in zip(runs["all"], targets, strict=False)) / len(targets)
    report = render(
        runs,
        ingest_s,
        bytes_after,
        live_bytes,
        full_bytes,
        limit,
        num_tokens,
        num_chunks,
        len(set(trace)),
        matched,
        policies,
        args,
    )
    args.out.write_text(report)
    args.out.with_suffix(".json").write_text(json.dumps({"runs": runs, "ingest_s": ingest_s, "policies": policies}))
    plot(runs, args.out.with_suffix(".png"))
    print(report)


def render(
    runs,
    ingest_s,
    bytes_after,
    live_bytes,
    full_bytes,
    limit,
    num_tokens,
    num_chunks,
    distinct,
    matched,
    policies,
    args,
) -> str:
    base = statistics.mean(r["ttft"] for r in runs["all"])
    second_base = statistics.mean(r["ttft"] for r in runs["all"][len(runs["all"]) // 2 :])
    lines = [
        "# Corpus scale: a 10% KV budget against all KV and none",
        "",
        f"Machine: {describe()}.",
        f"Corpus: the Python 3.11 library reference (Debian python3.11-doc), {num_tokens:,} tokens in {num_chunks:,} "
        f"chunks of at most {CHUNK_TOKENS} tokens; SmolLM2-135M in float32 on the CPU. {args.questions:,} questions, "
        f"each the first 16 words of a chunk drawn by Zipf({ZIPF_S}) over the chunks in random order (seed "
        f"{args.seed}); {distinct:,} distinct chunks asked; retrieval found the drawn chunk for {matched:.0%}. "
        "Replayed in order, first token only, one store after another in one run; the engine refreshes to the "
        "newest generation before each question (as the service does). The RAM tier is off (`ram_bytes=0`), so "
        "every hit is the store's; its default 1 GiB would add to every row but `none`.",
        "",
        f"Budget: 10% of the full store's KV ({limit / 1e9:.2f} of {full_bytes / 1e9:.2f} GB). `budget` is "
        "`ingest --kv-budget` (precomputes 10%, in document order: no questions yet) with KV computed on a miss and "
        "written back if popular enough; `none` is `--precompute none` with the write-back and the RAM tier off "
        "(every question prefills its chunk). `budget, day 2`: the same store after the nightly ingest (which "
        "re-plans the budget by popularity: its `ingest s` is that run), then 2,000 questions whose popularity "
        "moved: Zipf over a new random order of the chunks (seed + 1), so day 1's hot chunks are mostly cold; its "
        "TTFT ratio is against `all` on day 1's questions. `second half`: questions 1,001-2,000, once the budget "
        "has warmed up.",
        "",
        "| store | ingest s | KV bytes (catalog) | bytes on disk after replay | hit rate | first 200 | last 200 | mean TTFT s | "
        "p90 TTFT s | mean TTFT vs all | second half: mean TTFT vs all | KV from store / RAM / computed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, rows in runs.items():
        ttfts = [r["ttft"] for r in rows]
        sources = Counter(r["source"] for r in rows)
        lines.append(
            f"| {name} | {ingest_s[name]:.0f} | {live_bytes[name] / 1e9:.2f} GB | {bytes_after[name] / 1e9:.2f} GB | {hit_rate(rows):.1%} | "
            f"{hit_rate(rows[:200]):.0%} | {hit_rate(rows[-200:]):.0%} | {statistics.mean(ttfts):.3f} | "
            f"{p90(ttfts):.3f} | {statistics.mean(ttfts) / base:.2f}x | "
            f"{statistics.mean(ttfts[len(ttfts) // 2 :]) / second_base:.2f}x | "
            f"{sources['store']} / {sources['ram']} / {sources['computed'] + sources['live']} |"
        )
    lines += [
        "",
        "## The eviction policy, replayed offline on the same trace",
        "",
        f"The chunks the replay used, in order, against a cache of the same bytes ({limit / 1e9:.2f} GB less "
        "the system prompt's KV), empty at the start, storing a miss when the policy admits it. LFU and ragkv "
        "run ragkv's own budget plan (`ragkv.store.kv.budget.plan`): a miss is stored only when it is more popular than "
        "what it would evict. The second trace renames every chunk halfway, as when a new release moves "
        "what users ask about. ragkv's default half-life is 7 days of wall-clock time; here it is 200 questions, "
        "since a replay lasts minutes.",
        "",
        "| trace | " + " | ".join(next(iter(policies.values()))) + " |",
        "|---|" + "---|" * len(next(iter(policies.values()))),
    ]
    for label, rates in policies.items():
        lines.append(f"| {label} | " + " | ".join(f"{rate:.1%}" for rate in rates.values()) + " |")
    return "\n".join(lines) + "\n"


def plot(runs, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for name, rows in runs.items():
        xs = list(range(WINDOW, len(rows) + 1, WINDOW // 4))
        top.plot(xs, [hit_rate(rows[x - WINDOW : x]) for x in xs], label=name)
        bottom.plot(xs, [statistics.mean(r["ttft"] for r in rows[x - WINDOW : x]) for x in xs], label=name)
    top.set_ylabel(f"KV hit rate (last {WINDOW} questions)")
    bottom.set_ylabel(f"mean TTFT s (last {WINDOW})")
    bottom.set_xlabel("question")
    top.legend()
    top.set_title("10% KV budget vs all KV vs none (Zipf 1.1 questions)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
