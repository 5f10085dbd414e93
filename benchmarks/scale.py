"""The cost curve of a store against its size: what publishing, writing back, refreshing and
retrieving cost at 10k, 100k and 1M chunks (and 10M by a fit, unless measured).

Synthetic stores, no model: documents of CHUNKS_PER_DOC short texts (WORDS_PER_CHUNK words
drawn from a Zipf distribution over VOCABULARY words, as natural text's are), random unit vectors of
384 dims (all-MiniLM-L6-v2's) with the structure of a corpus: each document near one of
TOPICS random topic directions, each chunk near its document (uniformly random vectors have
no neighbours worth the name: every index degrades to a full scan on them, and no text
embeds so), one profile whose KV entries (rows only: a made-up shard name,
no bytes) cover 90% of the chunks, the rest left as misses. Every store is built through the
real write path (`StoreWriter`, `Catalog.add_documents`, `VectorIndex.add`), so its files are
what an ingest writes. Measured per size, on the same machine in one run:

  (a) a one-document change published (10 chunks replaced): seconds, bytes written;
  (b) a write-back batch of 16 misses (`WriteBack`'s batch: real shard, rows, publish);
  (c) a reader's refresh to the new generation: locally (open the new snapshot while holding
      the old), and through the S3 mirror (SeaweedFS on loopback), with bytes downloaded
      against the bytes the publish wrote;
  (d) retrieval p50/p99 over near-data queries and recall@10 against exact search;
  (e) the catalog lookups of the query path: context_rows (5 chunks), span ids, entry;
      and lexical search (BM25 over the segments' lexical files) for 4 words of a stored chunk;
  (f) a fresh reader's RAM (in its own process) and the store's disk.

    .venv/bin/python -m benchmarks.scale --sizes 10000 100000 1000000 --out benchmarks/results/scale.md

Real embeddings (`--real N`): N paragraphs of the Python standard library's documentation
strings embedded with all-MiniLM-L6-v2, held-out paragraphs as queries, recall@10 of an IVF
segment tuned as the store tunes it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.machine import describe  # noqa: E402
from ragkv.store.catalog import ChunkLink, ChunkRow, DocumentRow, ProfileRow  # noqa: E402
from ragkv.store.index.lexical import query_terms  # noqa: E402
from ragkv.store.kv.shards import SealedEntry  # noqa: E402
from ragkv.store.snapshot import open_snapshot  # noqa: E402
from ragkv.store.writer import StoreWriter  # noqa: E402

DIM = 384
CHUNKS_PER_DOC = 10
PROFILE = "synthetic-profile"
TOKENS = 16
REPEATS = 5
QUERIES = 200


TOPICS = 512
VOCABULARY = 50_000
WORDS_PER_CHUNK = 40
_WORDS = np.array([f"w{i}" for i in range(VOCABULARY)])


def zipf_words(rng, n: int) -> list[str]:
    """`n` words, word r drawn with probability ~ 1/r (the shape of natural text's frequencies)."""
    ranks = np.minimum(rng.zipf(1.1, n), VOCABULARY) - 1
    return _WORDS[ranks].tolist()


def unit(rng, n: int) -> np.ndarray:
    v = rng.standard_normal((n, DIM)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


_TOPICS = unit(np.random.default_rng(12345), TOPICS)


def corpus_vectors(rng, docs: int) -> np.ndarray:
    """CHUNKS_PER_DOC vectors per document: topic + noise for the document, document + noise
    for each chunk, normalised (cosine of a chunk to its document's other chunks ~0.55, to
    other documents of its topic ~0.44, to anything else ~0: a question's ten nearest chunks
    come from several documents)."""
    centres = _TOPICS[rng.integers(0, TOPICS, docs)] + 0.5 * unit(rng, docs)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    chunks = np.repeat(centres, CHUNKS_PER_DOC, axis=0) + 0.9 * unit(rng, docs * CHUNKS_PER_DOC)
    return chunks / np.linalg.norm(chunks, axis=1, keepdims=True)


def doc_rows(doc_ids, first_chunk: int, rng, version: int = 0):
    docs, chunks = [], []
    words = zipf_words(rng, len(doc_ids) * CHUNKS_PER_DOC * WORDS_PER_CHUNK)
    for d in doc_ids:
        docs.append(DocumentRow(d, f"synthetic/{d}.txt", f"hash-{d}-{version}", "synthetic", CHUNKS_PER_DOC))
        for i in range(CHUNKS_PER_DOC):
            start = len(chunks) * WORDS_PER_CHUNK
            text = f"{d} v{version} part {i}: " + " ".join(words[start : start + WORDS_PER_CHUNK])
            chunks.append(ChunkRow(first_chunk + len(chunks), d, i, text))
    return docs, chunks


def build(root: Path, n: int, rng) -> dict:
    """A store of `n` chunks through the real write path (writers of up to 250k chunks each),
    then `gc` as a nightly job runs it (one IVF segment, a compacted catalog)."""
    from ragkv.store.gc import collect_garbage

    start = time.perf_counter()
    profile = ProfileRow(PROFILE, "synthetic", "m", "t", "p", "", (1, 2, 3), "float32", "none", 2, 1, 4)
    num_docs = n // CHUNKS_PER_DOC
    batch_docs = 25_000
    shard = ""
    for first in range(0, num_docs, batch_docs):
        with StoreWriter(root) as writer:
            catalog = writer.catalog
            catalog.entries.add_profile(profile)
            if not shard:  # one real shard file the synthetic rows name (their bytes are never read)
                import torch

                shards = writer.shard_writer(1 << 20, {})
                sealed = shards.add("synthetic-seed", torch.zeros(1, 2, 1, 1, 2)) + shards.flush()
                catalog.entries.add_entries(PROFILE, sealed)
                shard = sealed[0].shard
            docs, chunks = doc_rows(
                [f"d{i:08d}" for i in range(first, min(num_docs, first + batch_docs))],
                catalog.documents.next_chunk_id(),
                rng,
            )
            catalog.documents.add_documents(docs, [{}] * len(docs), chunks)
            with_kv = [c for c in chunks if c.chunk_index != CHUNKS_PER_DOC - 1]  # 90%: the last chunk misses
            catalog.entries.add_entries(
                PROFILE, [SealedEntry(f"kv-{c.chunk_id}", shard, TOKENS, "float32", 512, "0") for c in with_kv]
            )
            catalog.entries.link_chunks(
                PROFILE, [ChunkLink(c.chunk_id, f"kv-{c.chunk_id}", tuple(range(TOKENS))) for c in with_kv]
            )
            writer.ensure_vectors(DIM).add([c.chunk_id for c in chunks], corpus_vectors(rng, len(docs)))
    built = time.perf_counter()
    collect_garbage(root)
    return {"build_s": built - start, "gc_s": time.perf_counter() - built}


def files(root: Path) -> dict[str, int]:
    return {
        str(p.relative_to(root)): p.stat().st_size
        for p in root.rglob("*")
        if p.is_file() and p.name != "LOCK" and not p.name.endswith(".tmp")
    }


def written(before: dict[str, int], after: dict[str, int]) -> int:
    return sum(size for name, size in after.items() if before.get(name) != size)


def publish_one_document(root: Path, rng, version: int) -> tuple[float, int, int]:
    with open_snapshot(root) as snap:
        docs = snap.catalog.con.execute("SELECT doc_id FROM documents USING SAMPLE 1 ROWS").fetchall()
    doc_id = docs[0][0]
    before = files(root)
    start = time.perf_counter()
    with StoreWriter(root) as writer:
        catalog = writer.catalog
        removed = catalog.documents.delete_documents([doc_id])
        writer.vectors.remove(removed)
        new_docs, chunks = doc_rows([doc_id], catalog.documents.next_chunk_id(), rng, version)
        catalog.documents.add_documents(new_docs, [{}], chunks)
        writer.vectors.add([c.chunk_id for c in chunks], corpus_vectors(rng, 1))
    after = files(root)
    lexical = {n: s for n, s in after.items() if n.startswith("segments/terms-")}
    return time.perf_counter() - start, written(before, after), written(before, lexical)


def write_back(root: Path, version: int) -> tuple[float, int]:
    import torch

    from ragkv.store.kv.writeback import ComputedKV, WriteBack

    with open_snapshot(root) as snap:
        misses = snap.catalog.con.execute(
            "SELECT chunk_id FROM chunks WHERE chunk_id NOT IN (SELECT chunk_id FROM chunk_kv) LIMIT 16"
        ).fetchall()
    batch = [
        ComputedKV(
            PROFILE,
            f"wb-{version}-{cid}",
            cid,
            tuple(range(TOKENS)),
            {"": torch.zeros(2, 2, 1, TOKENS, 4)},
            {"profile": PROFILE},
        )
        for (cid,) in misses
    ]
    writer = WriteBack(root)
    before = files(root)
    start = time.perf_counter()
    writer._write(batch)  # one batch, as the background thread writes it
    seconds = time.perf_counter() - start
    writer.close()
    assert writer.report.stored == len(batch), writer.report
    return seconds, written(before, files(root))


def refresh_local(root: Path, rng, version: int) -> float:
    """Open the generation after a publish while holding the one before (a long-lived reader)."""
    old = open_snapshot(root)
    old.vectors.search(unit(rng, 1)[0], 10)
    publish_one_document(root, rng, version)
    start = time.perf_counter()
    new = open_snapshot(root)
    new.vectors.search(unit(rng, 1)[0], 10)
    seconds = time.perf_counter() - start
    old.close()
    new.close()
    return seconds


def retrieval(root: Path, rng) -> dict:
    with open_snapshot(root) as snap:
        ids, vectors = snap.vectors.live_vectors()
        picks = rng.choice(len(ids), QUERIES, replace=False)
        queries = vectors[picks] + 0.7 * unit(rng, QUERIES)
        queries /= np.linalg.norm(queries, axis=1, keepdims=True)
        truth = ids[np.argpartition(-(queries @ vectors.T), 10, axis=1)[:, :10]]  # the exact ten, any order
        found, times = [], []
        for q in queries:
            start = time.perf_counter()
            hits = snap.vectors.search(q, 10)
            times.append(time.perf_counter() - start)
            found.append([h.chunk_id for h in hits])
        recall = np.mean([len(set(f) & set(t.tolist())) / 10 for f, t in zip(found, truth, strict=False)])
        chunk_ids = ids[rng.choice(len(ids), 100 * 5)].reshape(100, 5).tolist()
        lookups = {"context_rows": [], "span_chunk_ids": [], "entry": []}
        for group in chunk_ids:
            start = time.perf_counter()
            rows = snap.catalog.entries.context_rows(PROFILE, group)
            lookups["context_rows"].append(time.perf_counter() - start)
            start = time.perf_counter()
            snap.catalog.entries.span_chunk_ids(PROFILE, rows[0].doc_id, 0)
            lookups["span_chunk_ids"].append(time.perf_counter() - start)
            key = next((r.entry.kv_key for r in rows if r.entry), "kv-0")
            start = time.perf_counter()
            snap.catalog.entries.entry(key)
            lookups["entry"].append(time.perf_counter() - start)
        texts = snap.catalog.documents.chunk_texts(ids[rng.choice(len(ids), QUERIES, replace=False)].tolist())
        lexical = []
        for text in texts.values():
            words = text.split(": ", 1)[1].split()
            terms = query_terms(" ".join(rng.choice(words, 4, replace=False)))
            start = time.perf_counter()
            snap.vectors.search_terms(terms, 10)
            lexical.append(time.perf_counter() - start)
        index = snap.vectors.describe()
    out = {
        "lexical_p50_ms": pct(lexical, 50),
        "lexical_p99_ms": pct(lexical, 99),
        "search_p50_ms": pct(times, 50),
        "search_p99_ms": pct(times, 99),
        "recall_at_10": float(recall),
        "index": index,
    }
    for name, values in lookups.items():
        out[f"{name}_p50_ms"], out[f"{name}_p99_ms"] = pct(values, 50), pct(values, 99)
    return out


def pct(values, q) -> float:
    return float(np.percentile(values, q) * 1000)


def reader_ram(root: Path) -> int:
    """Resident bytes a fresh process gains by opening the store and answering one search."""
    code = (
        f"import sys, numpy as np; sys.path.insert(0, {str(ROOT)!r})\n"
        "from ragkv.store.snapshot import open_snapshot\n"
        "import faiss, duckdb, torch\n"
        "rss = lambda: int(open('/proc/self/statm').read().split()[1]) * 4096\n"
        "before = rss()\n"
        f"s = open_snapshot({str(root)!r}); v = np.ones({DIM}, np.float32); s.vectors.search(v / np.linalg.norm(v), 10)\n"
        f"s.catalog.entries.context_rows({PROFILE!r}, [0, 1, 2])\n"
        "print(rss() - before)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


@contextmanager
def s3(folder: Path):
    from tests import s3server

    if not s3server.available():
        yield None
        return
    with s3server.s3_server(folder) as endpoint:
        env = s3server.environment(endpoint)
        saved = {k: os.environ.get(k) for k in [*env, "RAGKV_HOME"]}
        os.environ.update(env)
        try:
            yield endpoint
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def refresh_s3(root: Path, work: Path, rng, version: int, n: int) -> dict:
    """Upload the store, let a reader's mirror copy it, publish one document through an S3
    writer (its own mirror), then time the reader's refresh and count what it downloads."""
    from ragkv.store.remote import RemoteStore
    from ragkv.store.writer import open_writer
    from tests import s3server

    uri = f"s3://{s3server.BUCKET}/scale-{n}"
    client = s3server.client(os.environ["AWS_ENDPOINT_URL"])
    for name in files(root):  # the store's objects, as a writer uploads them
        with open(root / name, "rb") as src, client.open_output_stream(f"{s3server.BUCKET}/scale-{n}/{name}") as dst:
            while block := src.read(8 << 20):
                dst.write(block)
    os.environ["RAGKV_HOME"] = str(work / "reader-home")
    reader = RemoteStore(uri)
    reader.sync()
    first = reader.downloaded
    os.environ["RAGKV_HOME"] = str(work / "writer-home")
    writer = open_writer(uri)
    mirror_before = files(writer.root)
    catalog = writer.catalog
    with open_snapshot(root) as snap:
        doc_id = snap.catalog.con.execute("SELECT doc_id FROM documents LIMIT 1").fetchone()[0]
    removed = catalog.documents.delete_documents([doc_id])
    writer.vectors.remove(removed)
    docs, chunks = doc_rows([doc_id], catalog.documents.next_chunk_id(), rng, version)
    catalog.documents.add_documents(docs, [{}], chunks)
    writer.vectors.add([c.chunk_id for c in chunks], corpus_vectors(rng, 1))
    start = time.perf_counter()
    writer.commit()
    publish_s = time.perf_counter() - start
    changed = written(mirror_before, files(writer.root))
    os.environ["RAGKV_HOME"] = str(work / "reader-home")
    reader.downloaded = 0
    start = time.perf_counter()
    reader.sync()
    seconds = time.perf_counter() - start
    return {
        "s3_first_sync_bytes": first,
        "s3_publish_s": publish_s,
        "s3_refresh_s": seconds,
        "s3_refresh_bytes": reader.downloaded,
        "s3_changed_bytes": changed,
    }


def du(root: Path) -> int:
    return sum(files(root).values())


def measure(n: int, work: Path, with_s3: bool) -> dict:
    rng = np.random.default_rng(n)
    root = work / f"store-{n}"
    result = {"chunks": n, **build(root, n, rng)}
    times, sizes, lexical = zip(*(publish_one_document(root, rng, v + 1) for v in range(REPEATS)), strict=False)
    result.update(
        publish_s=statistics.median(times),
        publish_max_s=max(times),
        publish_bytes=int(np.median(sizes)),
        publish_lexical_bytes=int(np.median(lexical)),
    )
    times, sizes = zip(*(write_back(root, v) for v in range(REPEATS)), strict=False)
    result.update(
        writeback_s=statistics.median(times), writeback_max_s=max(times), writeback_bytes=int(np.median(sizes))
    )
    result["refresh_local_s"] = statistics.median(refresh_local(root, rng, 100 + v) for v in range(3))
    result.update(retrieval(root, rng))
    result["reader_ram_bytes"] = reader_ram(root)
    result["disk_bytes"] = du(root)
    if with_s3:
        with s3(work / f"s3-{n}") as endpoint:
            if endpoint:
                result.update(refresh_s3(root, work, rng, 200, n))
    shutil.rmtree(root, ignore_errors=True)
    return result


def real_embeddings(count: int) -> dict:
    """Recall@10 of a tuned IVF segment on real embeddings: docstring paragraphs of the standard
    library, `count` indexed and 200 held out as queries."""
    import ast
    import sysconfig

    from ragkv.core.config import DEFAULT_EMBEDDER
    from ragkv.model.embed import Embedder
    from ragkv.store.index import build, segments

    paragraphs = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef, ast.Module)):
                doc = ast.get_docstring(node) or ""
                paragraphs += [p.strip() for p in doc.split("\n\n") if len(p.strip()) > 40]
        if len(paragraphs) > count + QUERIES:
            break
    paragraphs = list(dict.fromkeys(paragraphs))[: count + QUERIES]
    embedder = Embedder.load(DEFAULT_EMBEDDER, "cpu")
    start = time.perf_counter()
    vectors = embedder.embed_documents(paragraphs)
    embed_s = time.perf_counter() - start
    indexed, queries = vectors[QUERIES:], vectors[:QUERIES]
    ids = np.arange(len(indexed), dtype=np.int64)
    with tempfile.TemporaryDirectory() as tmp:
        info = build.build_segment(Path(tmp), ids, indexed, None, "real", ivf=True)
        segment = segments.load_segment(Path(tmp), info)
        truth = np.argsort(-(queries @ indexed.T), axis=1)[:, :10]
        found = [segment.search(q.reshape(1, -1), 10)[1][0] for q in queries]
    return {
        "paragraphs": len(indexed),
        "embed_s": embed_s,
        "nlist": info.nlist,
        "nprobe": info.nprobe,
        "tuned_recall": info.recall,
        "recall_at_10": build.recall_at(np.array(found), truth),
    }


def fit(sizes, values):
    """Slope and intercept of log(value) against log(size)."""
    slope, intercept = np.polyfit(np.log10(sizes), np.log10(np.maximum(values, 1e-9)), 1)
    return float(slope), float(intercept)


def report(results: list[dict], real: dict | None, out: Path, argv: str) -> None:
    sizes = [r["chunks"] for r in results]
    rows = [
        ("one-document publish (s, median of 5)", "publish_s", "{:.3f}"),
        ("one-document publish, bytes written", "publish_bytes", "{:,}"),
        ("... of which the lexical index", "publish_lexical_bytes", "{:,}"),
        ("write-back of 16 misses (s, median of 5)", "writeback_s", "{:.3f}"),
        ("write-back, bytes written", "writeback_bytes", "{:,}"),
        ("local refresh to a new generation (s)", "refresh_local_s", "{:.3f}"),
        ("S3 refresh (s)", "s3_refresh_s", "{:.3f}"),
        ("S3 refresh, bytes downloaded", "s3_refresh_bytes", "{:,}"),
        ("S3 publish, bytes changed", "s3_changed_bytes", "{:,}"),
        ("retrieval p50 (ms)", "search_p50_ms", "{:.2f}"),
        ("retrieval p99 (ms)", "search_p99_ms", "{:.2f}"),
        ("recall@10 vs exact", "recall_at_10", "{:.3f}"),
        ("lexical search p50 (ms)", "lexical_p50_ms", "{:.2f}"),
        ("lexical search p99 (ms)", "lexical_p99_ms", "{:.2f}"),
        ("context_rows p50 (ms)", "context_rows_p50_ms", "{:.2f}"),
        ("span_chunk_ids p50 (ms)", "span_chunk_ids_p50_ms", "{:.2f}"),
        ("entry p50 (ms)", "entry_p50_ms", "{:.2f}"),
        ("reader RAM (MiB)", "reader_ram_bytes", "mib"),
        ("store on disk (MiB)", "disk_bytes", "mib"),
        ("build through the write path (s)", "build_s", "{:.1f}"),
        ("gc after the build: compaction (s)", "gc_s", "{:.1f}"),
    ]
    lines = [
        "# Store cost against size",
        "",
        f"Machine: {describe()}",
        "",
        f"Command: `{argv}`",
        "",
        "| | " + " | ".join(f"{n:,} chunks" for n in sizes) + " |",
        "|---|" + "---|" * len(sizes),
    ]
    for label, key, form in rows:
        cells = []
        for r in results:
            v = r.get(key)
            cells.append("n/a" if v is None else f"{v / 2**20:.1f}" if form == "mib" else form.format(v))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Index per size: "
        + "; ".join(
            f"{r['chunks']:,}: {r['index']['type']}, {r['index']['segments']} segments, nlist {r['index']['nlist']}, "
            f"nprobe {r['index']['nprobe']}, lexical files {r['index'].get('lexical_bytes', 0) / 2**20:.1f} MiB"
            for r in results
        ),
    ]
    if len(sizes) >= 2:
        lines += ["", "Fits (log-log, cost ∝ N^slope) and 10M extrapolated:"]
        for label, key in (
            ("retrieval p50 ms", "search_p50_ms"),
            ("publish s", "publish_s"),
            ("write-back s", "writeback_s"),
        ):
            slope, intercept = fit(sizes, [r[key] for r in results])
            lines.append(f"- {label}: slope {slope:.2f}, at 10M ≈ {10 ** (intercept + slope * 7):.3g}")
    lines += [
        "",
        "Goals at 1M chunks: a one-document publish <= 2 s and within 3x of 10k; a write-back of 16 <= 1 s; "
        "an S3 refresh <= 2x the bytes changed; retrieval p50 <= 20 ms at recall@10 >= 0.95 (<= 30 ms at 10M). "
        "10M is not built through the write path here (its compaction reads 15 GB of float32 vectors into "
        "memory); the fits above extrapolate to it. Its IVF-PQ segment, built in batches, is measured in "
        "benchmarks/results/index_memory.md (697 MiB for the index, recall@10 0.973, search p50 10 ms). The "
        "large segment is IVF-PQ: codes in memory, the best candidates re-scored from the float32 vectors on disk.",
        "",
        "The 10k retrieval p99 (24 ms against a p50 of 0.7 ms) is a few outliers among the 200 searches of "
        "an exact 10k segment; not investigated.",
    ]
    if real:
        lines += [
            "",
            f"Real embeddings: {real['paragraphs']:,} standard-library docstring paragraphs (all-MiniLM-L6-v2), "
            f"200 held out as queries: IVF nlist {real['nlist']}, tuned nprobe {real['nprobe']} "
            f"(recall {real['tuned_recall']:.3f} on its tuning queries), recall@10 on the held-out "
            f"queries {real['recall_at_10']:.3f}.",
        ]
    out.write_text("\n".join(lines) + "\n")
    (out.with_suffix(".json")).write_text(json.dumps({"results": results, "real": real}, indent=1, default=str))
    plot(results, out.with_suffix(".png"))
    print("\n".join(lines))


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [r["chunks"] for r in results]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, key, scale in (
        ("one-document publish", "publish_s", 1000),
        ("write-back of 16", "writeback_s", 1000),
        ("local refresh", "refresh_local_s", 1000),
        ("S3 refresh", "s3_refresh_s", 1000),
        ("retrieval p50", "search_p50_ms", 1),
        ("context_rows p50", "context_rows_p50_ms", 1),
    ):
        values = [r.get(key) for r in results]
        if all(v is not None for v in values):
            ax.plot(sizes, [v * scale for v in values], marker="o", label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("chunks in the store")
    ax.set_ylabel("milliseconds")
    ax.set_title("ragkv store: cost against size")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--no-s3", action="store_true", help="skip the S3 refresh")
    parser.add_argument("--real", type=int, default=0, help="paragraphs of real text to embed (0: skip)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "scale.md")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("SCALE_TMP")) as tmp:
        for n in args.sizes:
            result = measure(n, Path(tmp), not args.no_s3)
            print(json.dumps(result, default=str), flush=True)
            results.append(result)
    real = real_embeddings(args.real) if args.real else None
    argv = "python -m benchmarks.scale " + " ".join(sys.argv[1:])
    report(results, real, args.out, argv)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "KiB peak")


if __name__ == "__main__":
    main()
