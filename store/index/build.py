"""Building a chunk index segment: exact (flat) below IVF_MIN vectors, else an inverted file of
product-quantised codes with an exact re-score table, its nprobe and re-score depth tuned on
the segment's own vectors for recall@10 >= RECALL_TARGET; and a segment's lexical file. Reading
and searching segments: ragkv.store.index.segments."""

from __future__ import annotations

import os
import uuid
from dataclasses import replace
from pathlib import Path

import faiss
import numpy as np

from ragkv.store.index.lexical import ANALYSER, Postings
from ragkv.store.index.segments import RESCORE, DiskVectors, SegmentInfo, rescore

IVF_MIN = 50_000  # a segment with fewer vectors is searched exactly


RECALL_TARGET = 0.95


_RESCORES = (RESCORE, 200, 400, 800, 1600, 3200)


PQ_DIMS_PER_CODE = 8  # dimensions a one-byte PQ code stands for


_NPROBES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)


_TUNE_QUERIES = 200


def build_segment(
    folder: Path,
    ids: np.ndarray,
    vectors: np.ndarray,
    postings: Postings | None,
    tag: str,
    ivf: bool | None = None,
    seed: int = 0,
) -> SegmentInfo:
    """Write `vectors` (normalised float32) under `ids` as a new segment, with `postings` (the
    same ids' words) as its lexical file; an "ivfpq" segment (and its vectors file) when there
    are at least IVF_MIN vectors (or `ivf`), its nprobe tuned here."""
    dim = vectors.shape[1]
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    use_ivf = len(ids) >= IVF_MIN if ivf is None else ivf
    folder.mkdir(parents=True, exist_ok=True)
    if use_ivf:
        info = _build_ivfpq(folder, ids, vectors, tag, seed)
    else:
        index = faiss.IndexIDMap2(faiss.IndexFlatIP(dim))
        index.add_with_ids(vectors, ids)
        name, nbytes = _write_new(folder, f"seg-{tag}", ".faiss", lambda path: faiss.write_index(index, str(path)))
        info = SegmentInfo(name, "flat", len(ids), nbytes)
    return with_terms(folder, info, postings, tag) if postings is not None else info


def _build_ivfpq(folder: Path, ids: np.ndarray, vectors: np.ndarray, tag: str, seed: int) -> SegmentInfo:
    """An "ivfpq" segment of `vectors` under `ids`: the coarse lists and the codes trained on a
    sample, the vectors file, and nprobe and the candidates tuned through the re-score."""
    rng = np.random.default_rng(seed)
    index = trained_ivfpq(vectors[rng.choice(len(vectors), training_rows(len(vectors)), replace=False)], len(ids), seed)
    index.add_with_ids(vectors, ids)
    order = np.argsort(ids, kind="stable")
    exact = (ids[order], vectors[order])
    nprobe, recall, candidates = tune_nprobe(index, *tuning_queries(ids, vectors, np.random.default_rng(seed)), exact)
    name, nbytes = _write_new(folder, f"seg-{tag}", ".faiss", lambda path: faiss.write_index(index, str(path)))
    vectors_name, vectors_nbytes = _write_new(folder, f"vec-{tag}", ".npy", lambda path: _save_npy(path, exact[1]))
    return SegmentInfo(
        name,
        "ivfpq",
        len(ids),
        nbytes,
        index.nlist,
        nprobe,
        recall,
        vectors=vectors_name,
        vectors_nbytes=vectors_nbytes,
        pq_bytes=index.code_size,
        rescore=candidates,
    )


def trained_ivfpq(sample: np.ndarray, count: int, seed: int = 0) -> faiss.IndexIVFPQ:
    """An empty "ivfpq" index for `count` vectors (ivf_lists(count) lists, codes of
    pq_codes(dim) bytes), trained on `sample` (`training_rows(count)` of them)."""
    dim = sample.shape[1]
    quantizer = faiss.IndexFlatIP(dim)
    index = faiss.IndexIVFPQ(quantizer, dim, ivf_lists(count), pq_codes(dim), 8, faiss.METRIC_INNER_PRODUCT)
    index.cp.seed = seed
    index.train(sample)
    index.own_fields = True
    quantizer.this.disown()
    return index


def training_rows(count: int) -> int:
    """Vectors an "ivfpq" index of `count` trains on: 40 per list, and at least 64 per code
    value (256 of them) for the codes."""
    return min(count, max(40 * ivf_lists(count), 64 * 256))


def _save_npy(path: Path, array: np.ndarray) -> None:
    with open(path, "wb") as f:
        np.save(f, array)


def _write_new(folder: Path, stem: str, suffix: str, write) -> tuple[str, int]:
    """A new uniquely named file `stem-<uuid>suffix` in `folder`, written by `write(path)` to a
    temporary name, synced, then renamed; returns (its name, its size)."""
    name = f"{stem}-{uuid.uuid4().hex[:8]}{suffix}"
    path = folder / name
    tmp = path.with_name(f".{name}.tmp")
    write(tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return name, path.stat().st_size


def pq_codes(dim: int) -> int:
    """Bytes of one vector's PQ code: one per PQ_DIMS_PER_CODE dimensions, a divisor of `dim`."""
    codes = max(1, dim // PQ_DIMS_PER_CODE)
    while dim % codes:
        codes -= 1
    return codes


def with_terms(folder: Path, info: SegmentInfo, postings: Postings, tag: str) -> SegmentInfo:
    """`info` with `postings` written as its (new) lexical file."""
    if len(postings.chunk_ids) != info.count:
        raise AssertionError(f"postings for {len(postings.chunk_ids)} chunks beside {info.count} vectors")
    name = f"terms-{tag}-{uuid.uuid4().hex[:8]}.safetensors"
    return replace(info, terms=name, terms_nbytes=postings.save(folder / name), analyser=ANALYSER)


def ivf_lists(n: int) -> int:
    """Inverted lists for `n` vectors: about sqrt(n), at least 64."""
    return int(max(64, min(65536, round(np.sqrt(n)))))


def tuning_queries(ids: np.ndarray, vectors: np.ndarray, rng) -> tuple[np.ndarray, np.ndarray]:
    """Queries near stored vectors (a stored vector plus noise, renormalised: the query is not
    one of the vectors) and their exact top-10 ids, `(Q, dim)` and `(Q, 10)`, to tune on."""
    picks = rng.choice(len(vectors), min(_TUNE_QUERIES, len(vectors)), replace=False)
    noise = rng.standard_normal((len(picks), vectors.shape[1])).astype(np.float32)
    noise /= np.linalg.norm(noise, axis=1, keepdims=True)
    queries = vectors[picks] + 0.7 * noise
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    flat = faiss.IndexFlatIP(vectors.shape[1])
    flat.add(vectors)
    _, rows = flat.search(queries, 10)
    return queries, ids[rows]


def tune_nprobe(
    index: faiss.IndexIVF,
    queries: np.ndarray,
    truth: np.ndarray,
    exact: tuple[np.ndarray, np.ndarray | DiskVectors] | None = None,
) -> tuple[int, float, int]:
    """The smallest nprobe whose recall@10 against `truth` (see `tuning_queries`) reaches
    RECALL_TARGET; with `exact` (an "ivfpq" segment's re-score table), through the re-score of
    the fewest candidates (_RESCORES) that reach it, raising nprobe at each only while recall
    still grows. Returns (nprobe, the recall measured, the candidates: 0 without `exact`); when
    nothing reaches the target, the last tried."""
    recall = 0.0
    for candidates in _RESCORES if exact is not None else (0,):
        previous = -1.0
        for nprobe in [n for n in _NPROBES if n < index.nlist] + [index.nlist]:
            params = faiss.SearchParametersIVF(nprobe=nprobe)
            if exact is None:
                _, found = index.search(queries, 10, params=params)
            else:
                _, near = index.search(queries, candidates, params=params)
                found = np.array(
                    [
                        np.pad(rescore(exact, q[None], c[None], 10)[1][0], (0, 10), constant_values=-1)[:10]
                        for q, c in zip(queries, near, strict=True)
                    ]
                )
            if (recall := recall_at(found, truth)) >= RECALL_TARGET:
                return nprobe, recall, candidates
            if exact is not None and recall <= previous + 0.002:
                break  # more lists no longer help: the codes' ranking limits it (more candidates may)
            previous = recall
    return nprobe, recall, candidates  # IVF-flat: every list, exact; PQ: the codes' limit


def recall_at(found: np.ndarray, truth: np.ndarray) -> float:
    """The share of the ids in `truth`'s rows that the same rows of `found` hold."""
    hits = total = 0
    for got, want in zip(found, truth, strict=False):
        want = want[want >= 0]
        hits += len(set(got.tolist()) & set(want.tolist()))
        total += len(want)
    return hits / max(total, 1)
