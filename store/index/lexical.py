"""The lexical index: BM25 over the chunks' words, kept in the same segments as the vectors.

Each vector segment (ragkv.store.index.segments) has a lexical part: a file of postings for the same chunk
ids (`seg-*.terms.safetensors`), so the lexical index follows the store's generations exactly
as the vectors do: a publish writes postings only for the chunks it adds, a removed chunk is
a tombstone shared with its vector, merges and compactions rewrite both parts together, and
an S3 mirror fetches only the new files.

Words are bm25s's tokens (lower-cased runs of two or more word characters) less its long
English stop-word list (which drops question words such as "what" and "how"; it gave better
recall@1 than the short list on all three sets of benchmarks/retrieval.py), stemmed by the
Snowball English stemmer (PyStemmer); runs of CJK characters, which have no spaces to split
on, become overlapping character pairs first (as Lucene's CJK analyser does). bm25s scores
one corpus indexed whole; a segmented index needs its statistics summed over segments at query
time (as Lucene does), so the scoring is here: BM25 with bm25s's defaults (k1 1.5, b 0.75,
Lucene's idf), over every live chunk of every segment.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from ragkv.core.errors import StoreCorruptError

ANALYSER = "bm25s-en_plus-snowball-cjk2"  # recorded per lexical file; another analyser's file is rebuilt
K1 = 1.5
B = 0.75
_CJK_RUN = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]{2,}")


@functools.cache
def _stemmer():
    import Stemmer

    return Stemmer.Stemmer("english")


def _cjk_pairs(text: str) -> str:
    """`text` with each run of CJK characters replaced by its overlapping character pairs."""
    return _CJK_RUN.sub(lambda m: " " + " ".join(m[0][i : i + 2] for i in range(len(m[0]) - 1)) + " ", text)


def analyse(texts: Sequence[str]) -> tuple[list[list[int]], list[str]]:
    """Each text's terms as ids into the returned vocabulary (stems), in text order."""
    import bm25s

    paired = [_cjk_pairs(t) for t in texts]
    tokenized = bm25s.tokenize(paired, stopwords="en_plus", stemmer=_stemmer(), show_progress=False)
    vocab = [""] * len(tokenized.vocab)
    for term, index in tokenized.vocab.items():
        vocab[index] = term
    return tokenized.ids, vocab


def query_terms(question: str) -> list[str]:
    """The distinct terms of a question (empty: nothing a lexical search can match on)."""
    ids, vocab = analyse([question])
    return list(dict.fromkeys(vocab[i] for i in ids[0]))


@dataclass
class Postings:
    """One segment's lexical part: for each term, the chunks holding it and how often.

    chunk_ids `(N,)` int64 and lengths `(N,)` int32 (terms per chunk) by row; for term t,
    rows[indptr[t]:indptr[t+1]] and tfs[...] (int32) are its postings, rows ascending."""

    chunk_ids: np.ndarray
    lengths: np.ndarray
    terms: list[str]
    indptr: np.ndarray
    rows: np.ndarray
    tfs: np.ndarray

    def __post_init__(self):
        self._term_index = {term: i for i, term in enumerate(self.terms)}

    @classmethod
    def of_texts(cls, chunk_ids: Sequence[int] | np.ndarray, texts: Sequence[str]) -> Postings:
        ids, vocab = analyse(texts)
        return cls.of_terms(np.asarray(chunk_ids, np.int64), ids, vocab)

    @classmethod
    def of_terms(cls, chunk_ids: np.ndarray, docs: Sequence[Sequence[int]], vocab: Sequence[str]) -> Postings:
        """Postings from each chunk's term ids (into `vocab`), terms sorted."""
        doc_rows = np.repeat(np.arange(len(docs), dtype=np.int64), [len(d) for d in docs])
        term_ids = np.fromiter((t for d in docs for t in d), np.int64, count=len(doc_rows))
        lengths = np.asarray([len(d) for d in docs], np.int32)
        order = np.argsort(np.asarray(vocab, dtype=object), kind="stable") if len(vocab) else np.empty(0, np.int64)
        rank = np.empty(len(vocab), np.int64)
        rank[order] = np.arange(len(vocab))
        return cls._from_pairs(chunk_ids, lengths, [vocab[i] for i in order], rank[term_ids], doc_rows)

    @classmethod
    def _from_pairs(
        cls,
        chunk_ids: np.ndarray,
        lengths: np.ndarray,
        terms: list[str],
        term_ids: np.ndarray,
        doc_rows: np.ndarray,
        counts: np.ndarray | None = None,
    ) -> Postings:
        """From (term id, row) pairs: one per occurrence (counted here), or distinct pairs with
        their `counts`; grouped by term, rows ascending."""
        width = max(len(chunk_ids), 1)
        keys = term_ids * width + doc_rows  # term-major, then row
        if counts is None:
            keys, counts = np.unique(keys, return_counts=True)
        else:
            order = np.argsort(keys, kind="stable")
            keys, counts = keys[order], counts[order]
        term_of, rows = np.divmod(keys, width)
        indptr = np.zeros(len(terms) + 1, np.int64)
        np.cumsum(np.bincount(term_of, minlength=len(terms)), out=indptr[1:])
        return cls(chunk_ids, lengths, terms, indptr, rows.astype(np.int32), np.asarray(counts, np.int32))

    @classmethod
    def joined(cls, parts: Sequence[tuple[Postings, np.ndarray]]) -> Postings:
        """The rows each `(postings, keep)` keeps (`keep`: a `(N,)` bool mask), as one."""
        terms = sorted({t for postings, _ in parts for t in postings.terms})
        index = {t: i for i, t in enumerate(terms)}
        chunk_ids, lengths, term_ids, doc_rows, counts = [], [], [], [], []
        offset = 0
        for postings, keep in parts:
            new_row = np.cumsum(keep) - 1 + offset  # (N,): the row a kept row becomes
            remap = np.asarray([index[t] for t in postings.terms], np.int64)
            term_of = np.repeat(np.arange(len(postings.terms)), np.diff(postings.indptr))  # (nnz,)
            kept = keep[postings.rows]  # (nnz,)
            term_ids.append(remap[term_of[kept]])
            doc_rows.append(new_row[postings.rows[kept]])
            counts.append(postings.tfs[kept])
            chunk_ids.append(postings.chunk_ids[keep])
            lengths.append(postings.lengths[keep])
            offset += int(keep.sum())

        def joined_(arrays: list[np.ndarray], dtype) -> np.ndarray:
            return np.concatenate(arrays) if arrays else np.empty(0, dtype)

        return cls._from_pairs(
            joined_(chunk_ids, np.int64),
            joined_(lengths, np.int32),
            terms,
            joined_(term_ids, np.int64),
            joined_(doc_rows, np.int64),
            joined_(counts, np.int32),
        )._pruned()

    def _pruned(self) -> Postings:
        """Without the terms no row holds any more (a join's dropped rows held them)."""
        held = np.diff(self.indptr) > 0
        if held.all():
            return self
        indptr = np.zeros(int(held.sum()) + 1, np.int64)
        np.cumsum(np.diff(self.indptr)[held], out=indptr[1:])
        terms = [t for t, keep in zip(self.terms, held, strict=True) if keep]
        return Postings(self.chunk_ids, self.lengths, terms, indptr, self.rows, self.tfs)

    def postings(self, term: str) -> tuple[np.ndarray, np.ndarray]:
        """(rows, tfs) of the chunks holding `term` (empty when none does)."""
        t = self._term_index.get(term)
        if t is None:
            return np.empty(0, np.int32), np.empty(0, np.int32)
        return self.rows[self.indptr[t] : self.indptr[t + 1]], self.tfs[self.indptr[t] : self.indptr[t + 1]]

    # -- files ----------------------------------------------------------------------------------
    def save(self, path: Path) -> int:
        """Write to `path` (a temporary name, fsynced, renamed); returns its size in bytes."""
        encoded = [t.encode("utf-8") for t in self.terms]
        offsets = np.zeros(len(encoded) + 1, np.int64)
        np.cumsum([len(e) for e in encoded], out=offsets[1:])
        tensors = {
            "chunk_ids": self.chunk_ids,
            "lengths": self.lengths,
            "term_bytes": np.frombuffer(b"".join(encoded) or b"\0", np.uint8).copy(),
            "term_offsets": offsets,
            "indptr": self.indptr,
            "rows": self.rows,
            "tfs": self.tfs,
        }
        tmp = path.with_name(f".{path.name}.tmp")
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(tmp), {"analyser": ANALYSER})
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return path.stat().st_size

    @classmethod
    def load(cls, path: Path) -> Postings:
        """Read a lexical file; ValueError (said in the caller's terms) when it is not one."""
        from safetensors import safe_open

        with safe_open(str(path), "numpy") as f:
            if (f.metadata() or {}).get("analyser") != ANALYSER:
                raise ValueError(f"written by another analyser ({(f.metadata() or {}).get('analyser')})")
        t = load_file(str(path))
        raw, offsets = t["term_bytes"].tobytes(), t["term_offsets"]
        terms = [raw[offsets[i] : offsets[i + 1]].decode("utf-8") for i in range(len(offsets) - 1)]
        postings = cls(t["chunk_ids"], t["lengths"], terms, t["indptr"], t["rows"], t["tfs"])
        if len(postings.indptr) != len(terms) + 1 or len(postings.rows) != postings.indptr[-1]:
            raise ValueError("its postings do not match its terms")
        return postings


def load_postings(path: Path, store: Path, count: int) -> Postings:
    """The lexical file at `path`, which must hold `count` chunks; StoreCorruptError naming it
    and the repair otherwise."""
    where = f"{path.parent.name}/{path.name}"
    repair = f"rebuild it with: ragkv verify --repair --store {store}"
    if not path.exists():
        raise StoreCorruptError(f"the lexical index file {where} is missing; {repair}")
    try:
        postings = Postings.load(path)
    except Exception as exc:  # safetensors reports a damaged file in many ways
        reason = str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
        raise StoreCorruptError(f"the lexical index file {where} is damaged ({reason}); {repair}") from None
    if len(postings.chunk_ids) != count:
        raise StoreCorruptError(
            f"the lexical index file {where} is damaged (holds {len(postings.chunk_ids)} chunks, not {count}); {repair}"
        )
    return postings


@dataclass(frozen=True)
class Scored:
    chunk_id: int
    score: float


def bm25(
    parts: Sequence[tuple[Postings, np.ndarray]], terms: Sequence[str], k: int, allowed: np.ndarray | None = None
) -> list[Scored]:
    """The `k` best chunks for `terms` by BM25, best first. parts: each segment's postings with
    its `(N,)` bool mask of live rows, whose statistics (chunks, mean length, document
    frequencies) the scores use; only chunks among `allowed` (ids) are returned when given."""
    live = [(p, alive) for p, alive in parts if alive.any()]
    num_chunks = sum(int(alive.sum()) for _, alive in live)
    if not num_chunks or not terms or k < 1:
        return []
    mean_length = max(sum(float(p.lengths[alive].sum()) for p, alive in live) / num_chunks, 1e-9)
    found = {term: [p.postings(term) for p, _ in live] for term in terms}
    frequency = {
        term: sum(int(alive[rows].sum()) for (rows, _), (_, alive) in zip(lists, live, strict=True))
        for term, lists in found.items()
    }
    scores, ids = [], []
    for i, (postings, alive) in enumerate(live):
        admitted = alive if allowed is None else alive & np.isin(postings.chunk_ids, allowed)
        total = np.zeros(len(postings.chunk_ids), np.float64)  # (N,)
        for term in terms:
            rows, tfs = found[term][i]
            if not len(rows) or not frequency[term]:
                continue
            idf = np.log(1 + (num_chunks - frequency[term] + 0.5) / (frequency[term] + 0.5))
            norm = K1 * (1 - B + B * postings.lengths[rows] / mean_length)  # (postings,)
            total[rows] += idf * tfs / (tfs + norm)  # Lucene's form (and bm25s's): no (k1 + 1) factor
        matched = np.flatnonzero((total > 0) & admitted)
        if len(matched) > k:
            matched = matched[np.argpartition(-total[matched], k - 1)[:k]]
        scores.append(total[matched])
        ids.append(postings.chunk_ids[matched])
    all_scores, all_ids = np.concatenate(scores), np.concatenate(ids)
    order = np.lexsort((all_ids, -all_scores))[:k]  # best first; ties by chunk id, so the order is stable
    return [Scored(int(all_ids[j]), float(all_scores[j])) for j in order]
