"""Spans under a 10% KV budget: Python library reference pages of 1-3k tokens, spans of 2048
tokens, questions whose chunks follow Zipf(1.1), each needing its chunk's span from the start
(`--context span`). Both parts in one run:

- ragkv's engine on a store that starts with no chunk KV (`--precompute 0`) under the budget,
  learning by write-back, against the same questions on a store with every span's KV: hit rate
  against the compulsory-miss ceiling, TTFT, and whether the first token agrees (float32);
- the budget's policy replayed offline on a longer trace (2,000 questions) against the
  alternatives: chunks kept one by one (no path), spans kept whole, and LRU on the tails
  (sglang's radix cache).

    python benchmarks/span_budget.py [--work DIR] [--tokens 200000] [--questions 2000] [--asked 300]
    python benchmarks/span_budget.py --work DIR --replay-only     (the replay at 5-50% budgets)

Writes benchmarks/results/span_budget.md (span_budget_replay.md with --replay-only).
"""

from __future__ import annotations

import argparse
import bisect
import shutil
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import ragkv  # noqa: E402
from benchmarks.corpus_scale import corpus, draw  # noqa: E402
from benchmarks.fidelity import work_dir  # noqa: E402
from benchmarks.machine import describe  # noqa: E402
from ragkv.core.config import AskSettings, IngestSettings, ModelSettings  # noqa: E402
from ragkv.model.llm import load_model  # noqa: E402
from ragkv.store import open_snapshot  # noqa: E402
from ragkv.store.kv.budget import Candidate, plan  # noqa: E402

CHUNK_TOKENS = 256
SPAN_TOKENS = 2048
BUDGET_SHARE = 0.10
ZIPF_S = 1.1
PAGE_TOKENS = (1000, 3000)


def ingest(docs: Path, store: Path, **settings) -> float:
    started = time.perf_counter()
    ragkv.ingest(
        [docs],
        store,
        model=ModelSettings(device="cpu", dtype="float32"),
        settings=IngestSettings(chunk_tokens=CHUNK_TOKENS, span_tokens=SPAN_TOKENS, **settings),
    )
    return time.perf_counter() - started


def span_layout(store: Path) -> tuple[dict[int, list[int]], dict[int, int], dict[int, str]]:
    """Per chunk: the path it needs (its span's chunks up to it), its KV bytes, and its text."""
    with open_snapshot(store) as snapshot:
        rows = snapshot.catalog.con.execute(
            "SELECT k.chunk_id, c.doc_id, k.span_start, e.nbytes, c.text FROM chunk_kv k JOIN chunks c USING (chunk_id) "
            "JOIN kv_entries e ON e.kv_key = k.kv_key ORDER BY c.doc_id, c.chunk_index"
        ).fetchall()
    paths, sizes, texts = {}, {}, {}
    span: list[int] = []
    for i, (chunk_id, doc_id, start, nbytes, text) in enumerate(rows):
        if i == 0 or (doc_id, start) != (rows[i - 1][1], rows[i - 1][2]):
            span = []
        span.append(chunk_id)
        paths[chunk_id], sizes[chunk_id], texts[chunk_id] = list(span), nbytes, text
    return paths, sizes, texts


def ceiling(paths: list[list[int]]) -> float:
    """The hit rate of an unbounded cache: every chunk use but each chunk's first."""
    seen: set[int] = set()
    uses = misses = 0
    for path in paths:
        for chunk in path:
            uses += 1
            misses += chunk not in seen
            seen.add(chunk)
    return 1 - misses / uses


# -- the engine ------------------------------------------------------------------------------
def ask_all(store: Path, questions: list[str], write_back: bool) -> list[dict]:
    """Ask each question in order (first token only, `--context span`); per question its TTFT,
    first token, the path of chunks it used and where each chunk's KV came from."""
    settings = AskSettings(context="span", top_k=1, max_new_tokens=1)
    out = []
    with ragkv.open(store, device="cpu", write_back=write_back, ram_bytes=0) as engine:
        for i, question in enumerate(questions):
            engine.refresh()  # as the service does between requests: see what the write-back stored
            answer = engine.ask(question, settings)
            sources = answer.stats.kv_sources
            out.append(
                {
                    "ttft": answer.stats.ttft_s,
                    "token": answer.token_ids[:1],
                    "path": [s.chunk_id for s in answer.sources],
                    "hits": sum(sources.get(s.chunk_id) in ("store", "ram") for s in answer.sources),
                    "uses": len(answer.sources),
                }
            )
            if (i + 1) % 50 == 0:
                recent = out[-50:]
                print(f"  {i + 1}: hit rate {rate(recent):.0%}", flush=True)
        if write_back:
            engine.flush()
    return out


# -- vLLM + the connector -------------------------------------------------------------------
def vllm_part(python: str, lazy: Path, full: Path, questions: list[str], work: Path) -> dict:
    """The same questions as `serve --engine vllm` sends them (span context, layout params),
    through vLLM + connector: on the empty budget store learning by its saves (hit rate from
    the store's hit log, as the connector logs it), and on the all-KV store with vLLM alone
    (no connector: a full prefill) on every fourth question."""
    from benchmarks.vllm_memory import SKIP, hits_logged
    from ragkv.core.config import DEFAULT_MODEL
    from tests import vllm_probe

    model = load_model(DEFAULT_MODEL, "cpu", "float32", weights=False).facts.path

    def probe(store: Path, runs: list[dict], kv_role: str) -> dict:
        """`runs` after a warm-up request (vLLM's first in a process pays for its warm-up); a
        context of 4096 tokens: a span of 2048 with the prefix and question passes 2048."""
        spec = {
            "kv_role": kv_role,
            "max_model_len": 4096,
            "runs": [{**runs[0], "name": "warmup", "params": SKIP}, *runs],
        }
        return vllm_probe.run(python, model, store, spec, work)

    from ragkv.serve.api import ServeSettings
    from ragkv.serve.stores import layout_params

    prompts = []
    with ragkv.open(lazy, device="cpu", weights=False) as engine:
        for question in questions:
            prompt = engine.prompt_for(question, AskSettings(context="span", top_k=1))
            prompts.append({"ids": prompt.prompt_ids, "params": layout_params(prompt, ServeSettings())})
    print("vLLM + connector, budget store learning", flush=True)
    learning = probe(lazy, [{"name": f"q{i}", **p} for i, p in enumerate(prompts)], "kv_both")
    hits = hits_logged(lazy)
    runs = []
    for i, p in enumerate(prompts):
        runs.append({"name": f"q{i}", **p})
        if i % 4 == 0:
            runs.append({"name": f"q{i}-full", "ids": p["ids"], "params": SKIP})
    print("vLLM + connector on the all-KV store, and vLLM alone", flush=True)
    served = probe(full, runs, "kv_consumer")
    with open_snapshot(lazy) as snapshot:
        kv_bytes = snapshot.catalog.reports.kv_bytes()
    return {"learning": learning, "hits": hits, "all": served, "kv_bytes": kv_bytes}


def rate(rows: list[dict]) -> float:
    return sum(r["hits"] for r in rows) / max(sum(r["uses"] for r in rows), 1)


# -- the policy, replayed offline -----------------------------------------------------------
def replay(paths: list[list[int]], sizes: dict[int, int], room: int, policy: str) -> float:
    """Chunk-use hit rate of a cache of `room` bytes over `paths` (each question's span path),
    starting empty. A chunk hits when it and every chunk before it on its path are held (the
    loader computes from the first gap on). Policies:
    "radix": ragkv's (`ragkv.store.kv.budget.plan` with parents and path-credited counts);
    "chunks": the same plan, each chunk on its own (no parents, its own count);
    "spans": a span admitted and evicted whole, by its count;
    "radix-lru": every miss admitted, the least recently used tail evicted first;
    "oracle": a fixed set chosen knowing the whole trace's counts (the radix plan over them),
    each chunk still missing on its first use: a reference for what a budget this size holds;
    "belady": every miss admitted, the tail whose next use is furthest in the future evicted
    first (Belady's rule, knowing the whole trace): a reference for what any policy that
    learns from misses reaches with this budget."""
    if policy == "oracle":
        return _oracle(paths, sizes, room)
    if policy == "belady":
        return _belady(paths, sizes, room)
    held: set[int] = set()
    counts: Counter[int] = Counter()
    last: dict[int, int] = {}
    hits = uses = 0
    for t, path in enumerate(paths):
        k = _held_prefix(path, held)
        hits, uses = hits + k, uses + len(path)
        counts.update(path)
        for chunk in path:
            last[chunk] = t
        if k == len(path):
            continue
        if policy == "radix-lru":
            held.update(path)
            _evict_lru_tails(held, sizes, room, last)
        elif policy == "spans":
            held = _spans_whole(held | set(path), sizes, room, counts)
        else:
            held = _planned(held, path[k:], sizes, room, counts, radix=policy == "radix")
    return hits / uses


_SPAN_OF: dict[int, list[int]] = {}  # chunk -> its whole span, set by main


def _held_prefix(path: list[int], held: set[int]) -> int:
    """How many of `path`'s chunks hit: those held before its first gap (the loader computes
    from the first gap on)."""
    k = 0
    while k < len(path) and path[k] in held:
        k += 1
    return k


def _oracle(paths: list[list[int]], sizes: dict[int, int], room: int) -> float:
    counts = Counter(c for path in paths for c in path)
    chosen = plan(
        [Candidate(str(c), sizes[c], _path_score(c, counts), False, c, _key(_parent(c))) for c in counts], room
    )
    held = {int(k) for k in chosen.compute}
    seen: set[int] = set()
    hits = uses = 0
    for path in paths:
        k = _held_prefix(path, held & seen)
        hits, uses = hits + k, uses + len(path)
        seen.update(path)
    return hits / uses


def _belady(paths: list[list[int]], sizes: dict[int, int], room: int) -> float:
    times: dict[int, list[int]] = {}
    for t, path in enumerate(paths):
        for chunk in path:
            times.setdefault(chunk, []).append(t)

    def next_use(chunk: int, t: int) -> float:
        later = times[chunk][bisect.bisect_right(times[chunk], t) :]
        return later[0] if later else float("inf")

    held: set[int] = set()
    hits = uses = 0
    for t, path in enumerate(paths):
        k = _held_prefix(path, held)
        hits, uses = hits + k, uses + len(path)
        if k == len(path):
            continue
        held.update(path[k:])
        used = sum(sizes[c] for c in held)
        while used > room:  # a chunk's use is its ancestors' too: the furthest tail is the furthest chunk
            tails = [c for c in held if not any(n in held for n in _children(c))]
            victim = max(tails, key=lambda c: (next_use(c, t), c))
            held.discard(victim)
            used -= sizes[victim]
    return hits / uses


def _parent(chunk: int) -> int | None:
    span = _SPAN_OF[chunk]
    i = span.index(chunk)
    return span[i - 1] if i else None


def _path_score(chunk: int, counts: Counter[int]) -> float:
    span = _SPAN_OF[chunk]
    return float(max(counts[c] for c in span[span.index(chunk) :]))


def _planned(held: set[int], fresh: list[int], sizes, room: int, counts: Counter[int], radix: bool) -> set[int]:
    def candidate(chunk: int, stored: bool) -> Candidate:
        if radix:
            return Candidate(str(chunk), sizes[chunk], _path_score(chunk, counts), stored, chunk, _key(_parent(chunk)))
        return Candidate(str(chunk), sizes[chunk], float(counts[chunk]), stored, chunk)

    decision = plan([candidate(c, True) for c in held] + [candidate(c, False) for c in fresh], room)
    return {int(k) for k in decision.keep + decision.compute}


def _key(chunk: int | None) -> str | None:
    return None if chunk is None else str(chunk)


def _evict_lru_tails(held: set[int], sizes, room: int, last: dict[int, int]) -> None:
    used = sum(sizes[c] for c in held)
    while used > room:
        tails = [c for c in held if not any(n in held for n in _children(c))]
        coldest = min(tails, key=lambda c: (last.get(c, -1), -c))
        held.discard(coldest)
        used -= sizes[coldest]


def _children(chunk: int) -> list[int]:
    span = _SPAN_OF[chunk]
    i = span.index(chunk)
    return span[i + 1 : i + 2]


def _spans_whole(held: set[int], sizes, room: int, counts: Counter[int]) -> set[int]:
    spans = {tuple(_SPAN_OF[c]) for c in held}
    ranked = sorted(spans, key=lambda s: (-sum(counts[c] for c in s), s[0]))
    kept: set[int] = set()
    used = 0
    for span in ranked:
        size = sum(sizes[c] for c in span)
        if used + size <= room:
            kept.update(span)
            used += size
    return kept


def spans_of(store: Path) -> tuple[dict[int, list[int]], dict[int, int], dict[int, str]]:
    """`span_layout` of `store`, each chunk's whole span noted for the replays."""
    paths, sizes, texts = span_layout(store)
    whole: dict[int, list[int]] = {}  # a span's first chunk -> the span
    for path in paths.values():
        if len(path) > len(whole.get(path[0], [])):
            whole[path[0]] = path
    _SPAN_OF.update({c: whole[path[0]] for c, path in paths.items()})
    return paths, sizes, texts


REPLAY_SHARES = (0.05, 0.10, 0.20, 0.30, 0.50)
REPLAY_POLICIES = ("radix", "oracle", "belady")


def replay_only(args, full: Path) -> None:
    """`--replay-only`: the policies replayed at several budgets over the all-KV store a full
    run left in --work; writes span_budget_replay.md beside span_budget.md."""
    paths, sizes, _ = spans_of(full)
    with open_snapshot(full) as snapshot:
        chunk_bytes = snapshot.catalog.reports.kv_bytes() - snapshot.catalog.reports.prefix_bytes()
    trace = [paths[c] for c in draw(sorted(paths), args.questions, args.seed)]
    top = ceiling(trace)
    lines = [
        "# Spans under a budget: how much of the compulsory-miss ceiling a budget can reach",
        "",
        f"Machine: {describe()}.",
        f"Command: `python benchmarks/span_budget.py {' '.join(sys.argv[1:])}` (the replay alone, over the "
        "all-KV store of the run in span_budget.md: the same corpus, chunks and Zipf draw).",
        f"{len(paths)} chunks, {chunk_bytes / 1e6:.0f} MB of chunk KV; {len(trace):,} questions, each needing its "
        f"drawn chunk's span path; compulsory-miss ceiling {top:.1%} (an unbounded store that learns every miss).",
        "",
        "| budget (share of chunk KV) | "
        + " | ".join(f"{p} hit rate | of ceiling" for p in REPLAY_POLICIES)
        + " | radix of belady |",
        "|---|" + "---|---|" * len(REPLAY_POLICIES) + "---|",
    ]
    found: dict[float, dict[str, float]] = {}
    for share in REPLAY_SHARES:
        found[share] = {p: replay(trace, sizes, int(chunk_bytes * share), p) for p in REPLAY_POLICIES}
        cells = [f"{found[share][p]:.1%} | {found[share][p] / top:.0%}" for p in REPLAY_POLICIES]
        lines.append(
            f"| {share:.0%} | " + " | ".join(cells) + f" | {found[share]['radix'] / found[share]['belady']:.0%} |"
        )
    reaching = [share for share, got in found.items() if got["radix"] >= 0.95 * top]
    at = found[BUDGET_SHARE]
    lines += [
        "",
        f"At a {BUDGET_SHARE:.0%} budget, Belady's rule, which knows the whole future (optimal when every entry "
        "has one size; chunks here are of up to 256 tokens, so it is a reference rather than a proven bound), "
        f"reaches {at['belady'] / top:.0%} of the compulsory-miss ceiling: 95% of it is beyond even Belady's rule "
        f"there. ragkv's policy reaches {at['radix'] / at['belady']:.0%} of Belady's, and 95% of "
        "the ceiling "
        + (
            f"from a {min(reaching):.0%} budget."
            if reaching
            else f"at none of the budgets up to {REPLAY_SHARES[-1]:.0%}."
        ),
        "",
        "radix: ragkv's policy (`ragkv.store.kv.budget.plan`: paths kept as prefixes, scores credited along the path). "
        "oracle: a fixed set chosen knowing the whole trace's counts (each chunk's first use still misses). "
        "belady: every miss admitted, the tail whose next use is furthest in the future evicted first "
        "(Belady's rule, knowing the whole trace).",
    ]
    out = args.out.with_name("span_budget_replay.md")
    out.write_text("\n".join(lines) + "\n")
    print(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=None, help="downloads and stores (reused if given)")
    parser.add_argument("--tokens", type=int, default=200_000, help="corpus size in LLM tokens")
    parser.add_argument("--questions", type=int, default=2000, help="questions of the offline replay")
    parser.add_argument("--asked", type=int, default=300, help="questions asked of the engine")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vllm-python", default=None, help="a python with vLLM: also run vLLM + connector")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "span_budget.md")
    parser.add_argument(
        "--replay-only",
        action="store_true",
        help="only the offline replay at several budgets (needs a full run's --work)",
    )
    args = parser.parse_args()
    work = work_dir(args.work, "span-budget")
    if args.replay_only:
        replay_only(args, work / "store-all")
        return
    tokenizer = load_model("smollm2", "cpu", "float32").tokenizer
    docs, num_tokens = corpus(work, args.tokens, tokenizer, PAGE_TOKENS)
    print(f"corpus: {len(list(docs.iterdir()))} pages, {num_tokens:,} tokens", flush=True)
    full, lazy = work / "store-all", work / "store-budget"
    for store in (full, lazy):
        shutil.rmtree(store, ignore_errors=True)
    ingest_s = {"all": ingest(docs, full)}
    with open_snapshot(full) as snapshot:
        full_bytes = snapshot.catalog.reports.kv_bytes()
        prefix_bytes = snapshot.catalog.reports.prefix_bytes()
    limit = prefix_bytes + int((full_bytes - prefix_bytes) * BUDGET_SHARE)
    ingest_s["budget"] = ingest(docs, lazy, kv_budget=limit, precompute=0)
    lazy_vllm = work / "store-budget-vllm"
    shutil.rmtree(lazy_vllm, ignore_errors=True)
    shutil.copytree(lazy, lazy_vllm)  # the same empty budget store, for vLLM to learn
    paths, sizes, texts = spans_of(full)
    drawn = draw(sorted(paths), args.questions, args.seed)
    questions = [" ".join(texts[c].split()[:16]) for c in drawn[: args.asked]]
    print(
        f"{len(paths)} chunks; budget {limit / 1e6:.0f} of {full_bytes / 1e6:.0f} MB; asking {len(questions)}",
        flush=True,
    )
    asked = {"all": ask_all(full, questions, write_back=False), "budget": ask_all(lazy, questions, write_back=True)}
    with open_snapshot(lazy) as snapshot:
        budget_bytes = snapshot.catalog.reports.kv_bytes()
    served = vllm_part(args.vllm_python, lazy_vllm, full, questions, work) if args.vllm_python else None
    room = limit - prefix_bytes
    trace = [paths[c] for c in drawn]
    names = ("radix", "chunks", "spans", "radix-lru", "oracle", "belady")
    replays = {name: replay(trace, sizes, room, name) for name in names}
    report = render(
        args, num_tokens, len(paths), full_bytes, limit, budget_bytes, ingest_s, asked, trace, replays, served
    )
    args.out.write_text(report)
    print(report)


def render(
    args, num_tokens, num_chunks, full_bytes, limit, budget_bytes, ingest_s, asked, trace, replays, served
) -> str:
    all_rows, budget_rows = asked["all"], asked["budget"]
    engine_ceiling = ceiling([r["path"] for r in budget_rows])
    agree = sum(a["token"] == b["token"] for a, b in zip(all_rows, budget_rows, strict=True))
    same_path = sum(a["path"] == b["path"] for a, b in zip(all_rows, budget_rows, strict=True))
    base = statistics.mean(r["ttft"] for r in all_rows)
    half = len(budget_rows) // 2
    trace_ceiling = ceiling(trace)
    lines = [
        "# Spans under a 10% KV budget",
        "",
        f"Machine: {describe()}.",
        f"Command: `python benchmarks/span_budget.py {' '.join(sys.argv[1:])}`.",
        f"Corpus: Python 3.11 library reference pages of {PAGE_TOKENS[0]:,}-{PAGE_TOKENS[1]:,} tokens (Debian "
        f"python3.11-doc), {num_tokens:,} tokens in {num_chunks:,} chunks of at most {CHUNK_TOKENS} tokens, spans "
        f"of {SPAN_TOKENS}; SmolLM2-135M in float32 on the CPU. Each question is the first 16 words of a chunk drawn "
        f"by Zipf({ZIPF_S}) over the chunks in random order (seed {args.seed}), asked with `--context span --top-k 1` (its "
        "span's chunks from the start up to it), first token only, the RAM tier off (every hit is the store's).",
        "",
        f"Budget: 10% of the chunk KV ({limit / 1e6:.0f} MB of {full_bytes / 1e6:.0f} MB with the system prompt's). "
        "`budget` starts with no chunk KV (`--precompute 0`) and learns by write-back; `all` holds every span's KV. "
        "Hit rate: of the chunks each prompt used, those whose KV came from the store. Compulsory-miss ceiling: "
        "the hit rate of an unbounded store that learns every miss (every chunk's first use misses).",
        "",
        "## ragkv's engine",
        "",
        "| store | ingest s | questions | hit rate | ceiling | of ceiling | second half hit rate | mean TTFT s | "
        "TTFT vs all | KV bytes after |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, rows in asked.items():
        ttft = statistics.mean(r["ttft"] for r in rows)
        cap = 1.0 if name == "all" else engine_ceiling
        lines.append(
            f"| {name} | {ingest_s[name]:.0f} | {len(rows)} | {rate(rows):.1%} | {cap:.1%} | {rate(rows) / cap:.0%} | "
            f"{rate(rows[half:]):.1%} | {ttft:.3f} | {ttft / base:.2f}x | "
            f"{(full_bytes if name == 'all' else budget_bytes) / 1e6:.0f} MB |"
        )
    lines += [
        "",
        f"First token equal to the all-KV store's: {agree}/{len(budget_rows)} (same retrieved path: {same_path}). "
        f"The budget store's KV stays within the budget ({budget_bytes / 1e6:.0f} MB of {limit / 1e6:.0f} MB).",
        "",
        *vllm_lines(served, engine_ceiling, budget_rows, limit),
        f"## The policy, replayed offline on {len(trace):,} questions",
        "",
        f"The same draw, longer, each question needing its drawn chunk's path; a cache of the budget's bytes less "
        f"the system prompt's, empty at the start. Compulsory-miss ceiling {trace_ceiling:.1%}. A chunk hits only "
        "when every chunk before it on its path is held (from the first gap on, the loader computes).",
        "",
        "| policy | what it does | hit rate | of ceiling | of the oracle |",
        "|---|---|---|---|---|",
    ]
    what = {
        "radix": "ragkv: paths kept as prefixes, scores credited along the path (`ragkv.store.kv.budget.plan`)",
        "chunks": "the same plan with every chunk on its own (no parents, own counts)",
        "spans": "a span kept or dropped whole, by its count",
        "radix-lru": "every miss admitted, least recently used tails evicted (sglang's radix cache)",
        "oracle": "a fixed set chosen knowing the whole trace's counts (each chunk's first use still misses)",
        "belady": "every miss admitted, the tail used furthest in the future evicted (Belady's rule, knowing the trace)",
    }
    for name, value in replays.items():
        lines.append(
            f"| {name} | {what[name]} | {value:.1%} | {value / trace_ceiling:.0%} | {value / replays['oracle']:.0%} |"
        )
    return "\n".join(lines) + "\n"


def vllm_lines(served: dict | None, engine_ceiling: float, budget_rows: list[dict], limit: int) -> list[str]:
    if served is None:
        return ["(vLLM not run: give --vllm-python.)", ""]
    hits = served["hits"]

    def seconds(result: dict, full: bool) -> list[float]:
        return [r["seconds"] for r in result["runs"] if r["name"] != "warmup" and r["name"].endswith("-full") == full]

    alone = statistics.mean(seconds(served["all"], True))
    loaded = statistics.mean(seconds(served["all"], False))
    learning = statistics.mean(seconds(served["learning"], False))
    firsts = {r["name"]: r["first_token"] for r in served["all"]["runs"]}
    learnt = {r["name"]: r["first_token"] for r in served["learning"]["runs"]}
    sampled = [n.removesuffix("-full") for n in firsts if n.endswith("-full")]
    agree = sum(learnt[n] == firsts[f"{n}-full"] for n in sampled)
    rate_vllm = sum(hits) / max(len(hits), 1)
    half = len(hits) // 2
    return [
        "## vLLM + the connector, same questions",
        "",
        "The prompts `serve --engine vllm` sends for the same questions (span context, layout params), one at a "
        "time through vLLM's offline engine (CPU build, prefix caching off, so every hit is the store's). "
        "`budget` learns from the same empty store through the connector's saves; `all` loads from the all-KV "
        "store; `vLLM alone` is a full prefill (every fourth question). Hit rate as the connector logged each use.",
        "",
        "| vLLM on | hit rate | of ceiling | second half | mean TTFT s | vs all | vs vLLM alone |",
        "|---|---|---|---|---|---|---|",
        f"| budget (learning) | {rate_vllm:.1%} | {rate_vllm / engine_ceiling:.0%} | "
        f"{sum(hits[half:]) / max(len(hits) - half, 1):.1%} | {learning:.3f} | {learning / loaded:.2f}x | "
        f"{learning / alone:.2f}x |",
        f"| all | 100.0% | - | - | {loaded:.3f} | 1.00x | {loaded / alone:.2f}x |",
        f"| vLLM alone | - | - | - | {alone:.3f} | {alone / loaded:.2f}x | 1.00x |",
        "",
        f"First token of the learning store equal to vLLM alone's: {agree}/{len(sampled)}. The store vLLM taught "
        f"holds {served['kv_bytes'] / 1e6:.0f} MB (budget {limit / 1e6:.0f} MB). Uses logged: {len(hits)} "
        f"(ragkv's engine: {sum(r['uses'] for r in budget_rows)}).",
        "",
    ]


if __name__ == "__main__":
    main()
