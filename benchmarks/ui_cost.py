"""What the dashboard costs the answer path: `ragkv serve`'s requests/s with the page closed
against open and refreshing, side by side in one run, on one server.

One `ragkv serve` on the sample store (bundled SmolLM2, float32); `--clients` streaming clients
ask the questions of benchmarks/questions.txt (`--tokens` new tokens each). Rounds alternate
"closed" (nothing else calls), "open" (`--pages` dashboards refreshing as the page does: its
charts and what is hot every `--every` seconds, a whole reload with the store panel every
`--reload`) and "hammered" (as many pages calling all three routes every second), `--repeats`
rounds each, the order rotated every repeat. The first round warms the server and is not counted.

    python benchmarks/ui_cost.py [--clients 4] [--pages 2] [--every 5] [--reload 10] [--repeats 6] [--passes 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.machine import describe  # noqa: E402
from benchmarks.serve_load import fresh_copy, level, ragkv_server, stream_ragkv  # noqa: E402

QUESTIONS = (ROOT / "benchmarks" / "questions.txt").read_text().splitlines()


class Pages:
    """`count` open dashboards. Each loads as the page does (the store panel, the charts' series,
    what is hot), then refreshes its charts and what is hot every `every` seconds and reloads
    the whole page every `reload` seconds."""

    def __init__(self, base: str, count: int, every: float, reload: float):
        self.base, self.every, self.reload = base, every, reload
        self.stop = threading.Event()
        self.calls = 0
        self.threads = [threading.Thread(target=self.refresh, daemon=True) for _ in range(count)]

    def refresh(self) -> None:
        loaded = -float("inf")
        with httpx.Client(base_url=self.base, timeout=60) as client:
            while not self.stop.is_set():
                paths = ["/v1/ui/series", "/v1/cache"]
                if time.monotonic() - loaded >= self.reload:
                    paths.insert(0, "/v1/ui/store")
                    loaded = time.monotonic()
                for path in paths:
                    client.get(path).raise_for_status()
                    self.calls += 1
                self.stop.wait(self.every)

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--pages", type=int, default=2)
    parser.add_argument("--every", type=float, default=5.0, help="the page's refresh of its charts (as it does: 5 s)")
    parser.add_argument("--reload", type=float, default=10.0, help="a whole reload (the store panel too)")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--passes", type=int, default=2, help="times each round asks the questions")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "ui_cost.md")
    args = parser.parse_args()
    import ragkv

    work = [(q, []) for q in QUESTIONS] * args.passes
    kinds = {  # the pages open in each kind of round: (count, every, reload)
        "closed": None,
        "open": (args.pages, args.every, args.reload),
        "hammered": (args.pages, 1.0, 1.0),  # every call each second: far more than a page makes
    }
    rows: dict[str, list[dict]] = {kind: [] for kind in kinds}
    calls = dict.fromkeys(kinds, 0)
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "store"
        ragkv.ingest([ROOT / "data"], store, model=ragkv.ModelSettings(device="cpu"))
        server = ragkv_server(fresh_copy(store, Path(tmp)), max_batch=16)
        try:
            call = lambda q, ids, tokens: stream_ragkv(server.base, q, ids, tokens)  # noqa: E731
            level(call, args.clients, work[: len(QUESTIONS)], args.tokens)  # warm-up: every document read once
            for repeat in range(args.repeats):
                names = list(kinds)
                order = names[repeat % 3 :] + names[: repeat % 3]  # rotated: each kind first, middle and last
                for kind in order:
                    pages = kinds[kind]
                    if pages is None:
                        rows[kind].append(level(call, args.clients, work, args.tokens))
                        continue
                    with Pages(server.base, *pages) as open_pages:
                        rows[kind].append(level(call, args.clients, work, args.tokens))
                    calls[kind] += open_pages.calls
                print({k: round(v[-1]["rps"], 3) for k, v in rows.items()}, file=sys.stderr, flush=True)
        finally:
            server.stop()
    median = {k: statistics.median(r["rps"] for r in v) for k, v in rows.items()}
    p50 = {k: statistics.median(r["p50"] for r in v) for k, v in rows.items()}
    lines = [
        "# The dashboard's cost on the answer path",
        "",
        f"`ragkv serve` on the sample store (bundled SmolLM2-135M-Instruct, float32), {args.clients} streaming clients, "
        f"the {len(QUESTIONS)} questions of benchmarks/questions.txt {args.passes} times per round, {args.tokens} new tokens. "
        f"open: {args.pages} dashboards refreshing as the page does (/v1/ui/series and /v1/cache every "
        f"{args.every:g} s) and reloading every {args.reload:g} s (/v1/ui/store too), {calls['open']} calls in all; "
        f"hammered: {args.pages} pages calling all three every second, {calls['hammered']} calls in all. "
        f"Rounds in turn, {args.repeats} of each, the order rotated each time, so each kind runs first, middle and "
        f"last as often (a server's rounds drift as it keeps conversations and logs uses), after a warm-up; one server. "
        f"CPU: {describe()}. Command: `python benchmarks/ui_cost.py`.",
        "",
        "| page | requests/s (median) | each round | TTFT p50 (median) | errors |",
        "|---|---|---|---|---|",
    ]
    for name in kinds:
        each = ", ".join(f"{r['rps']:.3f}" for r in rows[name])
        errors = sum(r["errors"] for r in rows[name])
        lines.append(f"| {name} | {median[name]:.3f} | {each} | {p50[name] * 1000:.0f} ms | {errors} |")
    ratios = [o["rps"] / c["rps"] for o, c in zip(rows["open"], rows["closed"], strict=True)]  # same repeat
    lines += [
        "",
        f"Each repeat's open round against its closed one: {', '.join(f'{r:.3f}x' for r in ratios)}.",
        f"Against closed: open {median['open'] / median['closed']:.3f}x the requests/s, "
        f"hammered {median['hammered'] / median['closed']:.3f}x.",
    ]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
