"""The FAISS index of chunk embeddings: inner product over normalised vectors (= cosine),
ids are catalog chunk ids. `IndexIDMap2(IndexFlatIP)` supports removal, which re-indexing needs
(HNSW does not)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import faiss
import numpy as np

from ragkv.errors import StoreCorruptError


@dataclass(frozen=True)
class Hit:
    chunk_id: int
    score: float


class VectorIndex:
    def __init__(self, index: "faiss.Index"):
        self.index = index
        self.num_changes = 0  # add/remove calls that changed the index since it was loaded

    @classmethod
    def empty(cls, dim: int) -> "VectorIndex":
        return cls(faiss.IndexIDMap2(faiss.IndexFlatIP(dim)))

    @classmethod
    def load(cls, path: Path) -> "VectorIndex":
        """The index in `path`; StoreCorruptError if it cannot be read (truncated, damaged)."""
        try:
            return cls(faiss.read_index(str(path)))
        except RuntimeError as exc:  # FAISS reports every read failure so
            # FAISS says "Error in <function> at <file:line>: <what>"; a short read is a truncated file.
            message = str(exc).splitlines()[0] if str(exc) else ""
            reason = "truncated" if "read error" in message else message.rpartition(": ")[2][:120] or "unreadable"
            raise StoreCorruptError(f"the vector index {path.name} is damaged ({reason}); rebuild it with: "
                                    f"ragkv verify --repair --store {path.parent}") from None

    @property
    def dim(self) -> int:
        return self.index.d

    def __len__(self) -> int:
        return self.index.ntotal

    def add(self, chunk_ids: list[int], vectors: np.ndarray) -> None:
        """vectors: `(N, dim)` float32, already normalised."""
        if len(chunk_ids):
            self.num_changes += 1
            self.index.add_with_ids(np.ascontiguousarray(vectors, dtype=np.float32), np.asarray(chunk_ids, dtype=np.int64))

    def remove(self, chunk_ids: list[int]) -> int:
        if not chunk_ids:
            return 0
        removed = self.index.remove_ids(np.asarray(chunk_ids, dtype=np.int64))
        self.num_changes += bool(removed)
        return removed

    def search(self, vector: np.ndarray, k: int, allowed: list[int] | None = None) -> list[Hit]:
        """The `k` nearest chunks to one `(dim,)` query vector, best first; only chunk ids in
        `allowed` when given."""
        k = min(k, len(allowed) if allowed is not None else self.index.ntotal)  # FAISS refuses k past its limits
        if k < 1:
            return []
        query = np.ascontiguousarray(vector.reshape(1, -1), dtype=np.float32)
        if allowed is None:
            scores, ids = self.index.search(query, k)
        else:
            selector = faiss.IDSelectorBatch(np.asarray(allowed, dtype=np.int64))
            scores, ids = self.index.search(query, k, params=faiss.SearchParameters(sel=selector))
        return [Hit(int(i), float(s)) for i, s in zip(ids[0], scores[0]) if i >= 0]

    def save(self, path: Path) -> None:
        """Write durably: to a temporary name, fsync, then rename over `path`."""
        tmp = path.with_name(f".{path.name}.tmp")
        faiss.write_index(self.index, str(tmp))
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
