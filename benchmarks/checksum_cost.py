"""What verifying a KV entry's checksum costs on the query path, side by side with reading it.

For SmolLM2-135M-shaped entries (30 layers x 2 x 3 KV heads x 64 dims) of 256..4096 tokens,
in float32 and bfloat16: the time to read the entry from a sealed shard (page cache warm),
the time of the xxh3-64 checksum over it, and the checksum's cost per MB.

    python benchmarks/checksum_cost.py [--repeats 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.machine import describe  # noqa: E402
from ragkv.store.kv.shards import ShardReader, ShardWriter, checksum  # noqa: E402


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "checksum.md")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in (torch.float32, torch.bfloat16):
            for tokens in (256, 1024, 4096):
                kv = torch.randn(30, 2, 3, tokens, 64).to(dtype)  # (L, 2, H, T, D)
                writer = ShardWriter(Path(tmp), max_bytes=1 << 40, metadata={})
                writer.add("entry", kv)
                (entry,) = writer.flush()
                reader = ShardReader(Path(tmp))
                # Timed within this iteration, so the loop's variables are the ones meant.
                read = lambda: reader._handle(entry.shard).get_tensor("entry")  # noqa: B023 - read only
                verified = lambda: reader.read(entry.shard, "entry", entry.checksum)  # noqa: B023
                tensor = verified()
                megabytes = entry.nbytes / 1e6
                read_ms = median_ms(read, args.repeats)
                hash_ms = median_ms(lambda: checksum(tensor), args.repeats)  # noqa: B023
                rows.append(
                    (
                        str(dtype).removeprefix("torch."),
                        tokens,
                        megabytes,
                        read_ms,
                        median_ms(verified, args.repeats),
                        hash_ms,
                    )
                )
    lines = [
        "# Checksum cost on the query path",
        "",
        f"xxh3-64 over each KV entry before use. {describe()}, torch {torch.__version__}; median of "
        f"{args.repeats}; page cache warm. Command: `python benchmarks/checksum_cost.py`.",
        "",
        "| dtype | tokens | entry MB | read ms | read + verify ms | checksum ms | checksum ms per MB | GB/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for dtype, tokens, mb, read_ms, both_ms, hash_ms in rows:
        lines.append(
            f"| {dtype} | {tokens} | {mb:.1f} | {read_ms:.2f} | {both_ms:.2f} | {hash_ms:.2f} | "
            f"{hash_ms / mb:.3f} | {mb / hash_ms:.1f} |"
        )
    args.out.write_text("\n".join(lines) + "\n")
    print(args.out.read_text())


if __name__ == "__main__":
    main()
