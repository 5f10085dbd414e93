"""A reader's index memory, recall and latency against the store's size: the IVF-flat segment
ragkv built before (float32 vectors in its lists, all in memory) against the IVF-PQ segment it
builds now (48-byte codes in memory, float32 vectors memory-mapped for an exact re-score of the
best candidates), on the same synthetic corpus-shaped vectors (benchmarks/scale.py's: documents
of 10 chunks around 200 topics, all-MiniLM-L6-v2's 384 dimensions), side by side in one run.

Each segment is loaded in a fresh process, which reports the resident memory it gained by
loading it and then answering 200 queries near stored vectors, recall@10 against exact search,
and p50/p99 per search.

    python benchmarks/index_memory.py --streamed 10000000   # 100k and 1M side by side, 10M IVF-PQ alone
                                                            # (15 GB on disk): writes results/index_memory.md
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import faiss
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.machine import describe  # noqa: E402
from benchmarks.scale import CHUNKS_PER_DOC, corpus_vectors, unit  # noqa: E402
from ragkv.store.index import build, segments  # noqa: E402

QUERIES = 200

CHILD = """
import json, sys, time
import numpy as np
sys.path.insert(0, {root!r})
from pathlib import Path
from ragkv.store.index import build, segments
from ragkv.store.index.segments import SegmentInfo
rss = lambda: int(open('/proc/self/statm').read().split()[1]) * 4096
queries, truth = np.load({queries!r}), np.load({truth!r})
before = rss()
segment = segments.load_segment(Path({folder!r}), SegmentInfo.from_dict(json.loads({info!r})))
loaded = rss() - before
found, times = [], []
for q in queries:
    start = time.perf_counter()
    _, ids = segment.search(q[None], 10)
    times.append(time.perf_counter() - start)
    found.append(np.pad(ids[0], (0, 10), constant_values=-1)[:10])
print(json.dumps({{"loaded": loaded, "after": rss() - before, "recall": build.recall_at(np.array(found), truth),
                  "p50": float(np.percentile(times, 50) * 1000), "p99": float(np.percentile(times, 99) * 1000)}}))
"""


def ivf_flat(folder: Path, ids: np.ndarray, vectors: np.ndarray) -> segments.SegmentInfo:
    """The segment ragkv built before IVF-PQ (its code as it was): IVF-flat, nprobe tuned."""
    dim, nlist = vectors.shape[1], build.ivf_lists(len(ids))
    quantizer = faiss.IndexFlatIP(dim)
    index = faiss.IndexIVFFlat(quantizer, dim, nlist, faiss.METRIC_INNER_PRODUCT)
    rng = np.random.default_rng(0)
    index.cp.seed = 0
    index.train(vectors[rng.choice(len(vectors), min(len(vectors), 40 * nlist), replace=False)])
    index.add_with_ids(vectors, ids)
    index.own_fields = True
    quantizer.this.disown()
    nprobe, recall, _ = build.tune_nprobe(index, *build.tuning_queries(ids, vectors, rng))
    name = "seg-flat-ivf.faiss"
    faiss.write_index(index, str(folder / name))
    return segments.SegmentInfo(name, "ivf", len(ids), (folder / name).stat().st_size, nlist, nprobe, recall)


def measure(size: int, work: Path) -> list[dict]:
    rng = np.random.default_rng(size)
    vectors = corpus_vectors(rng, size // CHUNKS_PER_DOC)
    ids = np.arange(len(vectors), dtype=np.int64)
    queries = vectors[rng.choice(len(vectors), QUERIES, replace=False)] + 0.7 * unit(rng, QUERIES)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    flat = faiss.IndexFlatIP(vectors.shape[1])
    flat.add(vectors)
    truth = ids[flat.search(queries, 10)[1]]
    del flat
    np.save(work / "queries.npy", queries)
    np.save(work / "truth.npy", truth)
    rows = []
    for kind in ("ivf-flat (before)", "ivf-pq + re-score (now)"):
        folder = work / kind.split()[0]
        folder.mkdir()
        start = time.perf_counter()
        info = (
            ivf_flat(folder, ids, vectors)
            if kind.startswith("ivf-flat")
            else build.build_segment(folder, ids, vectors, None, "bench", ivf=True)
        )
        rows.append(run_child(kind, size, work, folder, info, time.perf_counter() - start, vectors.shape[1]))
    return rows


def run_child(
    kind: str, size: int, work: Path, folder: Path, info: segments.SegmentInfo, build_s: float, dim: int
) -> dict:
    """The segment measured in a fresh process (see the module)."""
    code = CHILD.format(
        root=str(ROOT),
        queries=str(work / "queries.npy"),
        truth=str(work / "truth.npy"),
        folder=str(folder),
        info=json.dumps(info.to_dict()),
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    row = {
        "size": size,
        "kind": kind,
        "build_s": build_s,
        "disk": sum((folder / name).stat().st_size for name in info.files()),
        "estimate": info.ram_bytes(dim),
        "nlist": info.nlist,
        "nprobe": info.nprobe,
        "rescore": info.rescore,
        **json.loads(done.stdout.splitlines()[-1]),
    }
    print(json.dumps(row), file=sys.stderr)
    return row


def measure_streamed(size: int, work: Path, batch: int = 500_000) -> list[dict]:
    """The IVF-PQ segment at a size whose float32 vectors do not fit in memory beside the build
    (10M: 15 GB): the same index (`build.build_segment`'s type and parameters), trained on a
    sample, then added to and written to its vectors file a batch at a time; the exact top-10
    merged batch by batch, and nprobe and the candidates tuned by `build.tune_nprobe`. Vectors are drawn per batch from the same corpus
    shape (its topics are fixed), so any batch is a sample of the whole."""
    rng = np.random.default_rng(size)
    dim = 384
    folder = work / "ivfpq"
    folder.mkdir()
    start = time.perf_counter()
    first = corpus_vectors(rng, batch // CHUNKS_PER_DOC)
    index = build.trained_ivfpq(first[rng.choice(len(first), build.training_rows(size), replace=False)], size)
    picks = rng.choice(len(first), 2 * QUERIES, replace=False)  # tuning queries, then measured ones
    queries = first[picks] + 0.7 * unit(rng, 2 * QUERIES)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    vectors_path = folder / "vec-bench.npy"
    stored = np.lib.format.open_memmap(vectors_path, mode="w+", dtype=np.float32, shape=(size, dim))
    best_scores = np.full((len(queries), 10), -np.inf, np.float32)
    best_ids = np.full((len(queries), 10), -1, np.int64)
    done = 0
    while done < size:
        vectors = first if done == 0 else corpus_vectors(rng, batch // CHUNKS_PER_DOC)
        vectors = vectors[: size - done]
        ids = np.arange(done, done + len(vectors), dtype=np.int64)
        index.add_with_ids(vectors, ids)
        stored[done : done + len(vectors)] = vectors
        scores = queries @ vectors.T  # exact top-10 so far, merged batch by batch
        top = np.argpartition(-scores, 10, axis=1)[:, :10]
        merged_scores = np.concatenate([best_scores, np.take_along_axis(scores, top, 1)], axis=1)
        merged_ids = np.concatenate([best_ids, ids[top]], axis=1)
        keep = np.argsort(-merged_scores, axis=1)[:, :10]
        best_scores, best_ids = np.take_along_axis(merged_scores, keep, 1), np.take_along_axis(merged_ids, keep, 1)
        done += len(vectors)
        print(f"  {done:,} of {size:,} added", file=sys.stderr)
    stored.flush()
    del stored
    exact = (np.arange(size, dtype=np.int64), segments.DiskVectors(vectors_path))
    tune, measured = slice(0, QUERIES), slice(QUERIES, None)
    nprobe, recall, rescore = build.tune_nprobe(index, queries[tune], best_ids[tune], exact)
    faiss.write_index(index, str(folder / "seg-bench.faiss"))
    info = segments.SegmentInfo(
        "seg-bench.faiss",
        "ivfpq",
        size,
        (folder / "seg-bench.faiss").stat().st_size,
        index.nlist,
        nprobe,
        recall,
        vectors=vectors_path.name,
        vectors_nbytes=vectors_path.stat().st_size,
        pq_bytes=index.code_size,
        rescore=rescore,
    )
    build_s = time.perf_counter() - start
    del index, exact
    np.save(work / "queries.npy", queries[measured])
    np.save(work / "truth.npy", best_ids[measured])
    return [run_child("ivf-pq + re-score (now)", size, work, folder, info, build_s, dim)]


def render(rows: list[dict]) -> str:
    mib = 1 << 20
    lines = [
        "# Index memory against store size",
        "",
        f"Machine: {describe()}",
        "",
        "Command: `python benchmarks/index_memory.py`",
        "",
        "| chunks | segment | reader RAM after load / after 200 searches (MiB) | `ragkv stats` ram_bytes (MiB) | "
        "bytes per chunk in RAM | on disk (MiB) | recall@10 | p50 / p99 ms | nlist / nprobe / re-scored | build s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['size']:,} | {r['kind']} | {r['loaded'] / mib:.1f} / {r['after'] / mib:.1f} | "
            f"{r['estimate'] / mib:.1f} | {r['after'] / r['size']:.0f} | {r['disk'] / mib:.1f} | {r['recall']:.3f} | "
            f"{r['p50']:.2f} / {r['p99']:.2f} | {r['nlist']} / {r['nprobe']} / {r['rescore'] or '-'} | {r['build_s']:.1f} |"
        )
    lines += [
        "",
        "Reader RAM: resident bytes a fresh process gained by loading the segment, and after 200 searches (the "
        "re-score reads its rows with pread: the kernel's page cache holds them, not the process). Queries: stored vectors plus noise, "
        "renormalised; recall@10 against exact search over all vectors. Goal at 1M: reader RAM <= 400 MB at "
        "recall@10 >= 0.95 and p50 <= 20 ms.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--streamed", type=int, nargs="*", default=[], help="sizes built in batches (IVF-PQ only)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "index_memory.md")
    args = parser.parse_args()
    rows = []
    for size in args.sizes:
        with tempfile.TemporaryDirectory() as tmp:
            rows += measure(size, Path(tmp))
    for size in args.streamed:
        with tempfile.TemporaryDirectory() as tmp:
            rows += measure_streamed(size, Path(tmp))
    args.out.write_text(render(rows))
    print(args.out.read_text())


if __name__ == "__main__":
    main()
