"""Vector tombstones: the chunk ids removed from the vector segments since they were written
(kept in a delta's `vector_gone` table; a plain catalog has none). FAISS segments are
immutable, so a deleted chunk's vector stays in its segment and is skipped by id until the
segments are rebuilt."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from ragkv.store.catalog.overlay import GONE_VECTORS
from ragkv.store.catalog.part import Part


class Tombstones(Part):
    """`catalog.tombstones`: the vectors deleted since the segments were written."""

    def ids(self) -> np.ndarray:
        """The tombstoned chunk ids, ascending `(N,)` int64."""
        if not self.catalog.delta:
            return np.empty(0, np.int64)
        return (
            self.con.execute(f"SELECT chunk_id FROM {GONE_VECTORS} ORDER BY chunk_id")
            .fetchnumpy()["chunk_id"]
            .astype(np.int64)
        )

    def count(self) -> int:
        return self.catalog.value(f"SELECT count(*) FROM {GONE_VECTORS}") if self.catalog.delta else 0

    def replace(self, ids) -> None:
        """Make `ids` the tombstones (inside the writer's transaction)."""
        gone_ids = pa.table({"chunk_id": pa.array(list(map(int, ids)), pa.int64())})  # noqa: F841 (read by SQL)
        self.con.execute(f"DELETE FROM {GONE_VECTORS}")
        self.con.execute(f"INSERT INTO {GONE_VECTORS} SELECT chunk_id FROM gone_ids")
