"""Catalog lookups of the query path against the store's size: `context_rows` (5 chunks) as it
runs now, the one join it always was before, and point lookups alone (two pairs of queries side by side, as `context_rows` runs
them, and one query after another), side by side on the same stores, with `span_chunk_ids` and `entry` beside them.

Stores as benchmarks/scale.py builds them (synthetic documents through the real write path,
one profile whose KV rows cover 90% of the chunks), at each size; 300 lookups of 5 random
chunks each, the same for both.

    python benchmarks/lookups.py [--sizes 10000 100000 1000000]

Writes benchmarks/results/lookups.md.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from benchmarks.machine import describe  # noqa: E402
from benchmarks.scale import PROFILE, build  # noqa: E402
from ragkv.store import open_snapshot  # noqa: E402

LOOKUPS = 300


def p50_ms(values: list[float]) -> float:
    return statistics.median(values) * 1000


def p99_ms(values: list[float]) -> float:
    return float(np.percentile(values, 99)) * 1000


def measure(root: Path, n: int) -> dict:
    rng = np.random.default_rng(n)
    build(root, n, rng)
    with open_snapshot(root) as snap:
        catalog = snap.catalog

        def in_turn(first, second):
            return first(catalog.con), second(catalog.con)

        ids = [r[0] for r in catalog.con.execute("SELECT chunk_id FROM chunks").fetchall()]
        groups = [[ids[i] for i in rng.choice(len(ids), 5)] for _ in range(LOOKUPS)]
        times: dict[str, list[float]] = {
            "now": [],
            "join": [],
            "points": [],
            "in_turn": [],
            "span_chunk_ids": [],
            "entry": [],
        }
        catalog.entries.context_rows(PROFILE, groups[0])  # the store's size, counted once per generation
        for group in groups:  # interleaved, so drift in the machine's speed falls on all alike
            start = time.perf_counter()
            rows = catalog.entries.context_rows(PROFILE, group)
            times["now"].append(time.perf_counter() - start)
            start = time.perf_counter()
            joined = catalog.entries._joined_rows(PROFILE, group)  # what context_rows always was before
            times["join"].append(time.perf_counter() - start)
            start = time.perf_counter()
            points = catalog.entries._point_rows(PROFILE, group)
            times["points"].append(time.perf_counter() - start)
            catalog.side_by_side = in_turn  # the point lookups' queries one after the other
            start = time.perf_counter()
            one_by_one = catalog.entries._point_rows(PROFILE, group)
            times["in_turn"].append(time.perf_counter() - start)
            del catalog.side_by_side
            assert rows == points == joined == one_by_one
            start = time.perf_counter()
            catalog.entries.span_chunk_ids(PROFILE, rows[0].doc_id, 0)
            times["span_chunk_ids"].append(time.perf_counter() - start)
            key = next((r.entry.kv_key for r in rows if r.entry), "kv-0")
            start = time.perf_counter()
            catalog.entries.entry(key)
            times["entry"].append(time.perf_counter() - start)
    shutil.rmtree(root, ignore_errors=True)
    return {name: (p50_ms(v), p99_ms(v)) for name, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "lookups.md")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.sizes:
            results[n] = measure(Path(tmp) / f"store-{n}", n)
            print(n, results[n], flush=True)
    sizes = list(results)
    lines = [
        "# Catalog lookups against the store's size",
        "",
        f"Machine: {describe()}.",
        f"Command: `python benchmarks/lookups.py {' '.join(sys.argv[1:])}`.",
        f"{LOOKUPS} lookups of 5 random chunks per size, each timed every way in turn (ms, p50 / p99).",
        "",
        "| lookup | " + " | ".join(f"{n:,} chunks" for n in sizes) + " |",
        "|---|" + "---|" * len(sizes),
    ]
    names = {
        "now": "context_rows (now: point lookups, two pairs side by side)",
        "join": "one join (context_rows before)",
        "points": "point lookups, two pairs side by side",
        "in_turn": "point lookups, one query after another",
        "span_chunk_ids": "span_chunk_ids",
        "entry": "entry",
    }
    for key, name in names.items():
        lines.append(
            f"| {name} | " + " | ".join(f"{results[n][key][0]:.2f} / {results[n][key][1]:.2f}" for n in sizes) + " |"
        )
    first, last = sizes[0], sizes[-1]
    lines += [
        "",
        f"context_rows p50 at {last:,} chunks: {results[last]['now'][0]:.2f} ms, "
        f"{results[last]['now'][0] / results[first]['now'][0]:.2f}x its {first:,}-chunk figure "
        f"(the join alone: {results[last]['join'][0] / results[first]['join'][0]:.2f}x); "
        f"{results[last]['join'][0] / results[last]['now'][0]:.1f}x faster than the join at {last:,}.",
    ]
    args.out.write_text("\n".join(lines) + "\n")
    print(args.out.read_text())


if __name__ == "__main__":
    main()
