"""Popularity (uses per chunk, folded from the readers' hit logs) and the KV budget (a part of
`Catalog`: `catalog.usage`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import pyarrow as pa

from ragkv.store.catalog.part import Part
from ragkv.store.kv.popularity import HALF_LIFE_S, ChunkHits, Pending, decay, tally


class Usage(Part):
    def kv_budget(self) -> int | None:
        """Bytes of KV the store may hold (None: no budget)."""
        value = self.catalog.meta().get("kv_budget")
        return int(value) if value else None

    def half_life_s(self) -> float:
        """Seconds for a chunk's popularity to halve without uses (the `half_life_s` setting)."""
        return float(self.catalog.meta().get("half_life_s") or HALF_LIFE_S)

    def folded_offsets(self) -> dict[str, int]:
        return dict(self.con.execute("SELECT name, folded FROM hit_files").fetchall())

    def fold_uses(self, pending: Pending, half_life_s: float) -> int:
        """Add `pending` uses to `chunk_hits`, record the offsets they end at, and forget the
        files `pending` found finished. Returns the number of uses folded."""
        keys = {(u.doc_id, u.chunk_index) for u in pending.uses}
        rows = self.chunk_hits(keys)
        changed = tally(rows, pending.uses, half_life_s)
        new_hits = pa.table(
            {
                "doc_id": [k[0] for k in changed],
                "chunk_index": pa.array([k[1] for k in changed], pa.int32()),
                "hits": pa.array([rows[k].hits for k in changed], pa.int64()),
                "misses": pa.array([rows[k].misses for k in changed], pa.int64()),
                "uses": pa.array([rows[k].uses for k in changed], pa.int64()),
                "score": pa.array([rows[k].score for k in changed], pa.float64()),
                "last_use": pa.array([rows[k].last_use for k in changed], pa.float64()),
            }
        )
        offsets = pa.table(
            {"name": list(pending.offsets), "folded": pa.array(list(pending.offsets.values()), pa.int64())}
        )
        with self.catalog.transaction():
            self.catalog.insert_rows("chunk_hits", new_hits, replace=True)
            self.catalog.insert_rows("hit_files", offsets, replace=True)
            self.catalog.delete_rows("hit_files", "name IN (SELECT unnest(?))", [pending.finished])
        return len(pending.uses)

    def chunk_hits(self, keys: Iterable[tuple[str, int]] | None = None) -> dict[tuple[str, int], ChunkHits]:
        """Popularity rows by (doc_id, chunk_index): all of them, or those of `keys`."""
        sql = "SELECT doc_id, chunk_index, hits, misses, uses, score, last_use FROM chunk_hits"
        if keys is None:
            rows = self.con.execute(sql).fetchall()
        else:
            wanted = list(keys)
            if not wanted:
                return {}
            wanted_keys = pa.table(  # noqa: F841 - DuckDB scans it by its name in the query below
                {"doc_id": [k[0] for k in wanted], "chunk_index": pa.array([k[1] for k in wanted], pa.int32())}
            )
            rows = self.con.execute(sql + " JOIN wanted_keys USING (doc_id, chunk_index)").fetchall()
        return {(r[0], r[1]): ChunkHits(*r[2:]) for r in rows}

    def chunk_scores(self, chunk_ids: Sequence[int], now: float, half_life_s: float) -> dict[int, float]:
        """Each chunk's popularity score as of `now` (0 for a chunk never used)."""
        rows = self.con.execute(
            "SELECT c.chunk_id, h.score, h.last_use FROM chunks c JOIN chunk_hits h USING (doc_id, chunk_index) "
            "WHERE c.chunk_id IN (SELECT unnest(?))",
            [list(chunk_ids)],
        ).fetchall()
        scores = {r[0]: decay(r[1], r[2], now, half_life_s) for r in rows}
        return {i: scores.get(i, 0.0) for i in chunk_ids}
