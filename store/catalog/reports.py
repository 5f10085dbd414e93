"""Totals for `ragkv stats`, `verify` and `gc` (a part of `Catalog`: `catalog.reports`)."""

from __future__ import annotations

from collections.abc import Sequence

from ragkv.store.catalog.part import Part
from ragkv.store.catalog.rows import ENTRY_COLUMNS, EntryRow, ProfileTotals


class Reports(Part):
    def profile_totals(self) -> list[ProfileTotals]:
        """Per profile, newest first: its entries and their bytes, the chunks whose KV is stored
        and their tokens."""
        cursor = self.con.execute("""
            SELECT p.profile_id, p.model_name, p.dtype, p.kv_quant,
                   (SELECT count(*) FROM kv_entries e WHERE e.profile_id = p.profile_id) AS entries,
                   (SELECT coalesce(sum(nbytes), 0) FROM kv_entries e WHERE e.profile_id = p.profile_id) AS kv_bytes,
                   (SELECT count(*) FROM chunk_kv k SEMI JOIN kv_entries e ON e.kv_key = k.kv_key
                    WHERE k.profile_id = p.profile_id) AS chunks,
                   (SELECT coalesce(sum(len(token_ids)), 0) FROM chunk_kv k
                    SEMI JOIN kv_entries e ON e.kv_key = k.kv_key WHERE k.profile_id = p.profile_id) AS tokens,
                   p.kv_layout
            FROM profiles p ORDER BY p.created_at DESC""")
        return [ProfileTotals(*row) for row in cursor.fetchall()]

    def live_bytes_by_shard(self) -> dict[str, int]:
        return dict(self.con.execute("SELECT shard, sum(nbytes) FROM kv_entries GROUP BY shard").fetchall())

    def shards(self) -> set[str]:
        """Shard files this catalog references."""
        return {r[0] for r in self.con.execute("SELECT DISTINCT shard FROM kv_entries").fetchall()}

    def counts(self) -> dict[str, int]:
        tables = ("documents", "chunks", "kv_entries", "profiles")
        return {t: self.catalog.value(f"SELECT count(*) FROM {t}") for t in tables}

    def prefix_bytes(self) -> int:
        """Bytes of the system-prompt KV entries (of every profile): what no budget evicts."""
        return self.catalog.value("SELECT coalesce(sum(nbytes), 0) FROM kv_entries WHERE kind = 'prefix'")

    def kv_bytes(self) -> int:
        return self.catalog.value("SELECT coalesce(sum(nbytes), 0) FROM kv_entries")

    def all_entries(self) -> list[EntryRow]:
        rows = self.con.execute(f"SELECT {ENTRY_COLUMNS} FROM kv_entries e ORDER BY shard, tensor").fetchall()
        return [EntryRow(*r) for r in rows]

    def chunk_listing(self, profile_id: str, chunk_ids: Sequence[int]) -> list[tuple[str, str, int, int, bool, str]]:
        """`(doc_id, source, chunk_index, chunk_id, has_kv, opening)` for each of `chunk_ids`, by
        document and chunk: whether its KV is stored under `profile_id`, and its text's first
        160 characters (the dashboard's table of documents)."""
        return self.con.execute(
            """SELECT c.doc_id, d.source, c.chunk_index, c.chunk_id,
                      EXISTS (SELECT 1 FROM chunk_kv k SEMI JOIN kv_entries e ON e.kv_key = k.kv_key
                              WHERE k.chunk_id = c.chunk_id AND k.profile_id = ?),
                      left(c.text, 160)
               FROM chunks c JOIN documents d ON d.doc_id = c.doc_id
               WHERE c.chunk_id IN (SELECT unnest(?)) ORDER BY c.doc_id, c.chunk_index""",
            [profile_id, list(chunk_ids)],
        ).fetchall()
