"""Many teams on one `ragkv serve`: what scopes cost, and whether one tenant can time another's
prefix-cache hits. One run, one server at a time, on the sample corpus and the bundled SmolLM2
(float32, CPU).

1. Throughput, side by side in alternating rounds, 8 streaming clients on the same questions:
   - open: no keys;
   - keys, one tenant: every client its own key, all of one tenant, each key with a filter that
     admits every document (so the answers are the same and the filter's work is real): what
     checking keys and applying scopes costs;
   - keys, 8 tenants: the same, each client its own tenant, so the in-process prefix cache is
     kept per tenant. Every tenant asks every prompt here: the worst case for that split;
   - keys, 8 tenants + --isolate-tenants: the RAM tier keyed by tenant too (and no write-back).
   Each round starts a server, warms it (each client's questions once, through its key), then
   measures. Requests/s and time to first token, client side.
2. Timing, as an attacker would measure it (client side, time to the first streamed token):
   prompts of several chunks (top_k 5, context chunk), one request at a time. A third tenant W
   first asks every prompt, so every chunk's KV is in the RAM tier (shared by design: it tells
   only that someone allowed to read a document asked lately). Then per prompt, alternating who
   goes first: tenant A asks it, tenant B asks it, and A asks it again through a second key.
   - B repeating A's prompt against B's own first-seen prompts: no hit if the cache is salted;
   - A's second ask against A's first: the hit the same measurement sees within one tenant.
   The server's own count (the reply's prefix_cache_tokens) is reported beside the timings.

    python benchmarks/tenants.py [--rounds 2] [--prompts 60] [--out benchmarks/results/tenants.md]
"""

from __future__ import annotations

import argparse
import json
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
from benchmarks.serve_load import QUESTIONS, Server  # noqa: E402
from ragkv.serve.api_keys import key_digest  # noqa: E402

CLIENTS = 8
TOKENS = 32
ADMIT_ALL = "path!=nowhere/* or format=md"  # a real filter that every sample document passes
TIMING_OPTIONS = {"top_k": 5, "context": "chunk"}
NO_HANDBOOK = "path!=handbook/*"  # tenant n's scope: the handbook's documents do not exist for it
LOAD_OPTIONS = {"top_k": 4, "context": "chunk"}  # prompts of about 0.8k tokens


def keys_file(folder: Path) -> tuple[Path, dict[str, str]]:
    """A keys file: one key per throughput client (tenant c0 … c7), and the timing's tenants (w,
    a with two keys, b). Returns it and key by name."""
    keys = {f"c{i}": f"key-client-{i}" for i in range(CLIENTS)} | {f"s{i}": f"key-same-{i}" for i in range(CLIENTS)}
    keys |= {n: f"key-{n}" for n in ("w", "a1", "a2", "b", "n")}
    tenant = {name: ("a" if name.startswith("a") else "team" if name.startswith("s") else name) for name in keys}
    scope = {name: ADMIT_ALL for name in keys} | {"n": NO_HANDBOOK}
    entries = [
        f'[[keys]]\ntenant = "{tenant[name]}"\nsha256 = "{key_digest(key).hex()}"\nfilters = ["{scope[name]}"]\n'
        for name, key in keys.items()
    ]
    path = folder / "keys.toml"
    path.write_text("\n".join(entries))
    return path, keys


def server(store: Path, *args: str) -> Server:
    command = [sys.executable, str(ROOT / "cli.py"), "serve", "--store", str(store), "--port", "{port}"]
    return Server([*command, "--device", "cpu", "--max-queue", "64", *args])


def stream(base: str, question: str, key: str | None, options: dict, tokens: int) -> dict:
    """One streamed request: client-side time to first token, total, and the reply's ragkv stats."""
    body = {
        "model": "ragkv",
        "messages": [{"role": "user", "content": question}],
        "max_tokens": tokens,
        "stream": True,
        "ragkv": options,
    }
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    start, first, last = time.perf_counter(), None, None
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, headers=headers, timeout=600) as reply:
        if reply.status_code != 200:
            return {"error": f"HTTP {reply.status_code}"}
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if (event.get("choices") or [{}])[0].get("delta", {}).get("content"):
                first = first or time.perf_counter()
            last = event
    end = time.perf_counter()
    stats = (last or {}).get("ragkv", {}).get("stats", {})
    return {"ttft": (first or end) - start, "wall": end - start, "stats": stats, "sources": last["ragkv"]["sources"]}


def throughput_round(store: Path, name: str, args: tuple[str, ...], keys: dict[str, str] | None, prefix: str) -> dict:
    clients = [keys[f"{prefix}{i}"] if keys else None for i in range(CLIENTS)]
    work = [(q, clients[i % CLIENTS]) for i, q in enumerate(QUESTIONS * 3)]
    running = server(store, *args)
    try:
        with ThreadPoolExecutor(CLIENTS) as pool:  # warm: each client's own questions once, through its key
            list(
                pool.map(
                    lambda item: stream(running.base, item[0], item[1], LOAD_OPTIONS, 1), sorted(set(work), key=str)
                )
            )
            start = time.perf_counter()
            results = list(pool.map(lambda item: stream(running.base, item[0], item[1], LOAD_OPTIONS, TOKENS), work))
            wall = time.perf_counter() - start
    finally:
        running.stop()
    ok = [r for r in results if "error" not in r]
    ttfts = [r["ttft"] for r in ok]
    row = {
        "system": name,
        "requests": len(results),
        "errors": len(results) - len(ok),
        "rps": len(ok) / wall,
        "p50": float(np.median(ttfts)),
        "p90": float(np.percentile(ttfts, 90)),
        "answers": [tuple(s["chunk_id"] for s in r["sources"]) for r in ok],
        "prompt_tokens": [r["stats"]["prompt_tokens"] for r in ok],
    }
    print({k: v for k, v in row.items() if k != "answers"}, file=sys.stderr, flush=True)
    return row


def timing_prompts(base: str, key: str, count: int) -> list[str]:
    """Up to `count` questions whose multi-chunk prompts differ (each its own chunks, in order):
    the opening words of the sample corpus's chunks, then benchmarks/questions.txt."""
    from ragkv.store import open_snapshot

    with open_snapshot(STORE) as snapshot:
        texts = [t for (t,) in snapshot.catalog.con.execute("SELECT text FROM chunks ORDER BY chunk_id").fetchall()]
    candidates = [" ".join(t.split()[:14]) for t in texts if len(t.split()) > 20] + QUESTIONS
    seen, chosen = set(), []
    for question in candidates:
        found = httpx.post(
            f"{base}/v1/retrieve",
            json={"query": question, "top_k": TIMING_OPTIONS["top_k"]},
            headers={"Authorization": f"Bearer {key}"},
            timeout=600,
        ).json()["data"]
        combination = tuple(r["chunk_id"] for r in found)
        if len(combination) == TIMING_OPTIONS["top_k"] and combination not in seen:
            seen.add(combination)
            chosen.append(question)
        if len(chosen) == count:
            break
    return chosen


def timing(store: Path, folder: Path, keys: dict[str, str], count: int) -> dict:
    running = server(store, "--keys", str(folder / "keys.toml"))
    groups: dict[str, list[dict]] = {"a_first": [], "a_again": [], "b_first": [], "b_after_a": []}
    try:
        prompts = timing_prompts(running.base, keys["w"], count)
        ask = lambda q, who: stream(running.base, q, keys[who], TIMING_OPTIONS, 1)  # noqa: E731
        for question in prompts:
            ask(question, "w")  # the chunks' KV into the RAM tier, and W's own prefix entries
        for i, question in enumerate(prompts):
            if i % 2 == 0:
                groups["a_first"].append(ask(question, "a1"))
                groups["b_after_a"].append(ask(question, "b"))
                groups["a_again"].append(ask(question, "a2"))  # the same tenant, another key
            else:
                groups["b_first"].append(ask(question, "b"))
                ask(question, "a1")
        named = naming(running.base, keys["n"])
    finally:
        running.stop()
    return {"prompts": len(prompts), "groups": groups, "naming": named}


def naming(base: str, key: str, rounds: int = 150) -> dict[str, list[float]]:
    """Tenant n names, in /v1/retrieve's doc_ids, a document outside its scope or one that does
    not exist, alternately: both answer 400 with the same message; the times, client side."""
    from ragkv.store import open_snapshot

    with open_snapshot(STORE) as snapshot:
        hidden = snapshot.catalog.con.execute(
            "SELECT doc_id FROM documents WHERE doc_id LIKE 'handbook/%' ORDER BY doc_id LIMIT 1"
        ).fetchone()[0]
    times: dict[str, list[float]] = {"outside": [], "missing": []}
    said = {}
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=600) as client:
        for i in range(rounds * 2):
            which, doc_id = ("outside", hidden) if i % 2 == 0 else ("missing", "handbook/no-such-page.md")
            start = time.perf_counter()
            reply = client.post("/v1/retrieve", json={"query": "leave", "doc_ids": [doc_id]})
            times[which].append(time.perf_counter() - start)
            said[which] = (reply.status_code, reply.json()["error"]["message"].replace(doc_id, "ID"))
    times["same_reply"] = [float(said["outside"] == said["missing"])]
    return times


def bootstrap_diff(x: list[float], y: list[float], rounds: int = 4000) -> tuple[float, float, float]:
    """Median of x minus median of y, ms, with a 95% bootstrap interval."""
    rng = np.random.default_rng(0)
    a, b = np.array(x) * 1000, np.array(y) * 1000
    diffs = [np.median(rng.choice(a, a.size)) - np.median(rng.choice(b, b.size)) for _ in range(rounds)]
    return float(np.median(a) - np.median(b)), float(np.percentile(diffs, 2.5)), float(np.percentile(diffs, 97.5))


def render(rows: list[dict], timed: dict, args, prompt_tokens: list[int]) -> str:
    load_tokens = [t for r in rows for t in r["prompt_tokens"]]
    lines = [
        "# Many teams on one server: the cost of scopes, and cross-tenant prefix-cache timing",
        "",
        f"Machine: {describe()}. `python benchmarks/tenants.py --rounds {args.rounds} --prompts {args.prompts}`, "
        f"{time.strftime('%Y-%m-%d')}. Sample corpus, bundled SmolLM2-135M (float32), one server at a time.",
        "",
        f"## Throughput: {CLIENTS} streaming clients, {TOKENS} tokens per answer",
        "",
        f"{len(QUESTIONS) * 3} requests per round ({len(QUESTIONS)} questions x 3, top_k 4, context chunk: prompts "
        f"of {min(load_tokens)}-{max(load_tokens)} tokens, median {int(np.median(load_tokens))}), after a warm-up; "
        "rounds alternate the systems. Keys: each client its own key, with the filter "
        f"`{ADMIT_ALL}` (every document passes, so the answers are the same); one tenant for all, or "
        "one each (then every tenant keeps its own prefix-cache entries of the same prompts).",
        "",
        "| system | round | requests/s | TTFT p50 ms | TTFT p90 ms | errors |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['system']} | {row['round']} | {row['rps']:.2f} | {row['p50'] * 1000:.0f} | "
            f"{row['p90'] * 1000:.0f} | {row['errors']} |"
        )
    lines += [
        "",
        "| system | requests/s (median of rounds) | against open | TTFT p50 ms (median) |",
        "|---|---|---|---|",
    ]
    base = np.median([r["rps"] for r in rows if r["system"] == "open"])
    for name in dict.fromkeys(r["system"] for r in rows):
        rps = float(np.median([r["rps"] for r in rows if r["system"] == name]))
        p50 = float(np.median([r["p50"] for r in rows if r["system"] == name]))
        lines.append(f"| {name} | {rps:.2f} | {rps / base:.3f}x | {p50 * 1000:.0f} |")
    same = len({tuple(sorted(r["answers"])) for r in rows}) == 1
    lines += ["", f"Every system's answers cite the same chunks: {'yes' if same else 'NO'}.", ""]
    groups = timed["groups"]
    ms = {name: [r["ttft"] for r in group] for name, group in groups.items()}
    hits = {name: sum(r["stats"].get("prefix_cache_tokens", 0) > 0 for r in group) for name, group in groups.items()}
    lines += [
        "## Timing: can tenant B see tenant A's prefix-cache hits?",
        "",
        f"{timed['prompts']} prompts of {TIMING_OPTIONS['top_k']} chunks each (context chunk), each its own chunks in order; prompt "
        f"tokens {min(prompt_tokens)}-{max(prompt_tokens)}, median {int(np.median(prompt_tokens))}. One request at "
        "a time; client-side time to the first streamed token. Every chunk's KV was in the RAM tier first "
        "(tenant W asked every prompt).",
        "",
        "| group | n | TTFT p10 ms | p50 ms | p90 ms | server saw a prefix-cache hit |",
        "|---|---|---|---|---|---|",
    ]
    labels = {
        "a_first": "A asks a prompt first",
        "a_again": "A asks it again (another key, same tenant)",
        "b_first": "B asks a prompt first (A never did)",
        "b_after_a": "B asks A's prompt",
    }
    for name, label in labels.items():
        p10, p50, p90 = (np.percentile(ms[name], q) * 1000 for q in (10, 50, 90))
        lines.append(
            f"| {label} | {len(ms[name])} | {p10:.0f} | {p50:.0f} | {p90:.0f} | {hits[name]} of {len(ms[name])} |"
        )
    cross = bootstrap_diff(ms["b_after_a"], ms["b_first"])
    within = bootstrap_diff(ms["a_again"], ms["a_first"])
    lines += [
        "",
        "Median differences, ms, with 95% bootstrap intervals:",
        "",
        f"- B asking A's prompt minus B's own first-seen: {cross[0]:+.1f} [{cross[1]:+.1f}, {cross[2]:+.1f}]",
        f"- A asking again minus A's first ask: {within[0]:+.1f} [{within[1]:+.1f}, {within[2]:+.1f}]",
        "",
    ]
    named = timed["naming"]
    gap = bootstrap_diff(named["outside"], named["missing"])
    lines += [
        "## Naming a document outside the scope",
        "",
        f"Tenant n's scope is `{NO_HANDBOOK}`. It sends `/v1/retrieve` with `doc_ids` naming a handbook document "
        f"(outside its scope) or a document that does not exist, alternately, {len(named['outside'])} times each. "
        f"Same status and message (the id aside): {'yes' if named['same_reply'][0] else 'NO'}.",
        "",
        "| doc_ids names | p10 ms | p50 ms | p90 ms |",
        "|---|---|---|---|",
    ]
    for which in ("outside", "missing"):
        p10, p50, p90 = (np.percentile(named[which], q) * 1000 for q in (10, 50, 90))
        lines.append(
            f"| {'a document outside the scope' if which == 'outside' else 'no document'} | {p10:.2f} | {p50:.2f} | {p90:.2f} |"
        )
    lines += ["", f"Median difference: {gap[0]:+.2f} ms [{gap[1]:+.2f}, {gap[2]:+.2f}].", ""]
    return "\n".join(lines)


def plot(timed: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = timed["groups"]
    order = ["a_first", "a_again", "b_first", "b_after_a"]
    names = ["A first", "A again\n(same tenant)", "B first", "B repeats A"]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.boxplot([[r["ttft"] * 1000 for r in groups[g]] for g in order], showfliers=True)
    ax.set_xticks(range(1, 5), names)
    ax.set_ylabel("time to first token, ms (client side)")
    ax.set_title("Prefix-cache hits are a tenant's own")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


STORE = Path()


def main() -> None:
    global STORE
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=60)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "tenants.md")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        STORE = folder / "store"
        subprocess.run(
            [sys.executable, "-m", "ragkv", "ingest", str(ROOT / "data"), "--store", str(STORE), "--quiet"],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        _, keys = keys_file(folder)
        keyed = ("--keys", str(folder / "keys.toml"))
        systems = {
            "open": ((), None, ""),
            "keys, one tenant": (keyed, keys, "s"),
            "keys, 8 tenants": (keyed, keys, "c"),
            "keys, 8 tenants, isolated": ((*keyed, "--isolate-tenants"), keys, "c"),
        }
        rows = []
        for round_ in range(1, args.rounds + 1):
            for name, (extra, used, prefix) in systems.items():
                rows.append({"round": round_, **throughput_round(STORE, name, extra, used, prefix)})
        timed = timing(STORE, folder, keys, args.prompts)
        prompt_tokens = [r["stats"]["prompt_tokens"] for g in timed["groups"].values() for r in g]
    args.out.write_text(render(rows, timed, args, prompt_tokens))
    plot(timed, args.out.with_suffix(".png"))
    print(args.out.read_text())


if __name__ == "__main__":
    main()
