"""Profiles, KV entries, and the links from chunks to the entries holding their KV, spans
included (a part of `Catalog`: `catalog.entries`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence, Set

import pyarrow as pa

from ragkv.store.catalog.part import Part
from ragkv.store.catalog.rows import (
    ENTRY_COLUMNS,
    ChunkLink,
    ContextRow,
    EntryRow,
    ProfileRow,
    SpanChunk,
    SpanLink,
    pages_of,
)
from ragkv.store.kv.shards import SealedEntry

POINT_LOOKUPS = 16  # context_rows probes each table for up to this many ids, and joins beyond


class Entries(Part):
    def add_profile(self, row: ProfileRow) -> None:
        """Insert a profile row unless its id is already present."""
        exists = self.con.execute("SELECT 1 FROM profiles WHERE profile_id = ?", [row.profile_id]).fetchone()
        if not exists:
            values = [list(v) if isinstance(v, tuple) else v for v in (getattr(row, c) for c in ProfileRow.COLUMNS)]
            self.catalog.insert_rows(
                "profiles",
                select=f"SELECT {', '.join(f'? AS {c}' for c in ProfileRow.COLUMNS)}, "
                "current_timestamp::TIMESTAMP AS created_at",
                params=values,
            )

    def profiles(self) -> list[ProfileRow]:
        """Profile rows, newest first."""
        rows = self.con.execute(f"SELECT {', '.join(ProfileRow.COLUMNS)} FROM profiles ORDER BY created_at DESC")
        return [ProfileRow(*row[:6], tuple(row[6] or ()), *row[7:]) for row in rows.fetchall()]  # type: ignore[call-arg]

    def profile(self, profile_id: str) -> ProfileRow | None:
        return next((p for p in self.profiles() if p.profile_id == profile_id), None)

    def add_entries(self, profile_id: str, entries: Sequence[SealedEntry], prefix_keys: Set[str] = frozenset()) -> None:
        """Commit rows for entries of sealed shards (one transaction). Entries named in
        `prefix_keys` are the shared prefix KV; the rest are chunks."""
        if not entries:
            return
        new_entries = pa.table(
            {
                "kv_key": [e.name for e in entries],
                "profile_id": [profile_id] * len(entries),
                "kind": ["prefix" if e.name in prefix_keys else "chunk" for e in entries],
                "shard": [e.shard for e in entries],
                "tensor": [e.name for e in entries],
                "num_tokens": pa.array([e.num_tokens for e in entries], pa.int32()),
                "dtype": [e.dtype for e in entries],
                "nbytes": pa.array([e.nbytes for e in entries], pa.int64()),
                "checksum": [e.checksum for e in entries],
            }
        )
        with self.catalog.transaction():
            self.catalog.insert_rows(
                "kv_entries",
                new_entries,
                "SELECT DISTINCT ON (kv_key) *, current_timestamp::TIMESTAMP AS created_at "
                "FROM rows WHERE kv_key NOT IN (SELECT kv_key FROM kv_entries)",
            )

    def existing_keys(self, keys: Iterable[str]) -> set[str]:
        wanted = list(keys)
        if not wanted:
            return set()
        rows = self.con.execute("SELECT kv_key FROM kv_entries WHERE kv_key IN (SELECT unnest(?))", [wanted]).fetchall()
        return {r[0] for r in rows}

    def entry(self, kv_key: str) -> EntryRow | None:
        row = self.con.execute(f"SELECT {ENTRY_COLUMNS} FROM kv_entries e WHERE kv_key = ?", [kv_key]).fetchone()
        return EntryRow(*row) if row else None

    def link_chunks(self, profile_id: str, links: Sequence[ChunkLink]) -> None:
        """Record, for each link, which KV entry holds its chunk under `profile_id`."""
        new_links = pa.table(
            {
                "chunk_id": pa.array([link.chunk_id for link in links], pa.int64()),
                "profile_id": [profile_id] * len(links),
                "kv_key": [link.kv_key for link in links],
                "token_ids": pa.array([list(link.token_ids) for link in links], pa.list_(pa.int32())),
                "span_start": pa.array([link.span_start for link in links], pa.int32()),
            }
        )
        self.catalog.delete_rows(
            "chunk_kv", "profile_id = ? AND chunk_id IN (SELECT chunk_id FROM rows)", [profile_id], new_links
        )
        self.catalog.insert_rows(
            "chunk_kv", new_links, "SELECT chunk_id, profile_id, kv_key, token_ids, span_start FROM rows"
        )

    def span_chunk_ids(self, profile_id: str, doc_id: str, span_start: int) -> list[int]:
        """Chunk ids of the span of `doc_id` that starts at chunk_index `span_start`, in order."""
        rows = self.con.execute(
            "SELECT c.chunk_id FROM chunks c JOIN chunk_kv k USING (chunk_id) WHERE k.profile_id = ? AND c.doc_id = ? "
            "AND coalesce(k.span_start, c.chunk_index) = ? AND c.chunk_index >= ? ORDER BY c.chunk_index",
            [profile_id, doc_id, span_start, span_start],
        ).fetchall()
        return [r[0] for r in rows]

    def span_links(self, kv_key: str) -> list[SpanLink]:
        """Every chunk of the span holding `kv_key`, in order (one for a chunk whose KV stands
        alone; none when no chunk links to the key)."""
        rows = self.con.execute(
            """
            WITH target AS (
                SELECT k.profile_id, c.doc_id, coalesce(k.span_start, c.chunk_index) AS start, k.span_start
                FROM chunk_kv k JOIN chunks c USING (chunk_id) WHERE k.kv_key = ? LIMIT 1)
            SELECT k.kv_key, k.token_ids FROM chunk_kv k JOIN chunks c USING (chunk_id), target t
            WHERE k.profile_id = t.profile_id AND c.doc_id = t.doc_id
              AND ((t.span_start IS NULL AND k.kv_key = ?) OR (t.span_start IS NOT NULL AND k.span_start = t.start))
            ORDER BY c.chunk_index
            """,
            [kv_key, kv_key],
        ).fetchall()
        return [SpanLink(r[0], tuple(r[1])) for r in rows]

    def chunks_of_keys(self, profile_id: str, kv_keys: Sequence[str]) -> list[tuple[str, int, str]]:
        """(kv_key, chunk_id, doc_id) of every chunk linked to one of `kv_keys` under
        `profile_id` (a key of identical text may serve several chunks), by chunk id."""
        if not kv_keys:
            return []
        rows = self.con.execute(
            "SELECT k.kv_key, k.chunk_id, c.doc_id FROM chunk_kv k JOIN chunks c USING (chunk_id) "
            "WHERE k.profile_id = ? AND k.kv_key IN (SELECT unnest(?)) ORDER BY k.chunk_id",
            [profile_id, list(kv_keys)],
        ).fetchall()
        return [(r[0], int(r[1]), r[2]) for r in rows]

    def linked_totals(self, profile_id: str, doc_ids: Sequence[str]) -> tuple[int, int]:
        """(chunks, tokens) of `doc_ids` that already have KV under `profile_id`."""
        row = self.catalog.one(
            "SELECT count(*), coalesce(sum(len(k.token_ids)), 0) FROM chunk_kv k JOIN chunks c USING (chunk_id) "
            "SEMI JOIN kv_entries e ON e.kv_key = k.kv_key WHERE k.profile_id = ? AND c.doc_id IN (SELECT unnest(?))",
            [profile_id, list(doc_ids)],
        )
        return int(row[0]), int(row[1])

    def linked_chunk_ids(self, profile_id: str) -> set[int]:
        """Chunks whose KV the store holds under `profile_id` (a span's chunk linked without an
        entry is not one: its KV was deferred or evicted)."""
        rows = self.con.execute(
            "SELECT chunk_id FROM chunk_kv k SEMI JOIN kv_entries e ON e.kv_key = k.kv_key WHERE k.profile_id = ?",
            [profile_id],
        ).fetchall()
        return {r[0] for r in rows}

    def drop_profiles(self, profile_ids: Sequence[str]) -> None:
        """Forget profiles with their chunk links and KV entry rows (files stay until gc)."""
        ids = list(profile_ids)
        for table in ("chunk_kv", "kv_entries", "profiles"):
            self.catalog.delete_rows(table, "profile_id IN (SELECT unnest(?))", [ids])

    def dead_entries(self) -> list[EntryRow]:
        """Entries nothing needs: chunk KV no chunk links to; prefix KV of dropped profiles, or
        of every profile once the store holds no chunks. (A profile may link no chunk and still
        need its prefix: under a KV budget, chunks get KV on their first question.)"""
        rows = self.con.execute(f"""
            SELECT {ENTRY_COLUMNS} FROM kv_entries e
            WHERE (e.kind = 'chunk' AND e.kv_key NOT IN (SELECT kv_key FROM chunk_kv))
               OR (e.kind = 'prefix' AND (e.profile_id NOT IN (SELECT profile_id FROM profiles)
                                          OR NOT EXISTS (SELECT 1 FROM chunks)))
            ORDER BY e.shard""").fetchall()
        return [EntryRow(*r) for r in rows]

    def delete_entries(self, kv_keys: Iterable[str]) -> None:
        self.catalog.delete_rows("kv_entries", "kv_key IN (SELECT unnest(?))", [list(kv_keys)])

    def move_entries(self, sealed: Sequence[SealedEntry]) -> None:
        """Point existing entry rows at the shards their bytes were copied into."""
        moves = pa.table({"kv_key": [e.name for e in sealed], "shard": [e.shard for e in sealed]})
        with self.catalog.transaction():
            self.catalog.insert_rows(
                "kv_entries",
                moves,
                "SELECT e.* REPLACE (m.shard AS shard, m.kv_key AS tensor) "
                "FROM kv_entries e JOIN rows m USING (kv_key)",
                replace=True,
            )

    def entries_in(self, shard: str) -> list[EntryRow]:
        rows = self.con.execute(f"SELECT {ENTRY_COLUMNS} FROM kv_entries e WHERE shard = ?", [shard]).fetchall()
        return [EntryRow(*r) for r in rows]

    def entry_lengths(self, profile_id: str) -> list[int]:
        """The distinct token counts of `profile_id`'s chunk entries, longest first."""
        rows = self.con.execute(
            "SELECT DISTINCT num_tokens FROM kv_entries WHERE profile_id = ? AND kind = 'chunk' ORDER BY 1 DESC",
            [profile_id],
        ).fetchall()
        return [r[0] for r in rows]

    def chunk_link(self, chunk_id: int, profile_id: str) -> ChunkLink | None:
        """The chunk's link under `profile_id` (its key, token ids and span), None if it has none."""
        row = self.con.execute(
            "SELECT kv_key, token_ids, span_start FROM chunk_kv WHERE chunk_id = ? AND profile_id = ?",
            [chunk_id, profile_id],
        ).fetchone()
        return ChunkLink(chunk_id, row[0], tuple(row[1]), row[2]) if row else None

    def links_without_entries(self) -> list[tuple[int, str, str]]:
        """(chunk_id, profile_id, kv_key) of links of chunks stored alone whose KV entry row is
        missing (a span's chunk without an entry is not one: a budget left its KV out)."""
        return self.con.execute(
            "SELECT chunk_id, profile_id, kv_key FROM chunk_kv WHERE span_start IS NULL "
            "AND kv_key NOT IN (SELECT kv_key FROM kv_entries) ORDER BY chunk_id"
        ).fetchall()

    def token_ids_of(self, kv_key: str) -> tuple[int, ...] | None:
        """The chunk token ids an entry's key was made from (any chunk linked to it)."""
        row = self.con.execute("SELECT token_ids FROM chunk_kv WHERE kv_key = ? LIMIT 1", [kv_key]).fetchone()
        return tuple(row[0]) if row else None

    def linked_profiles(self) -> set[str]:
        return {r[0] for r in self.con.execute("SELECT DISTINCT profile_id FROM chunk_kv").fetchall()}

    def context_rows(self, profile_id: str, chunk_ids: Sequence[int]) -> list[ContextRow]:
        """Rows for `chunk_ids`, in that order, joined with their source and their KV entry.

        Up to POINT_LOOKUPS ids (a question's context) are point lookups, each table probed
        for its keys, so their cost barely grows with the store; a join of the ids against
        chunk_kv scans it (benchmarks/results/lookups.md: at 1M chunks on 2 CPU cores, 3.9
        against the join's 95 ms; at 10k, 3.6 against 5.4). For more ids (a rerank's
        candidates) one join is the cheaper."""
        if len(set(chunk_ids)) > POINT_LOOKUPS:
            return self._joined_rows(profile_id, chunk_ids)
        return self._point_rows(profile_id, chunk_ids)

    def _point_rows(self, profile_id: str, chunk_ids: Sequence[int]) -> list[ContextRow]:
        """`context_rows` as point lookups."""
        ids = list(dict.fromkeys(chunk_ids))
        if not ids:
            return []

        # Each a semi-join against the ids (`IN (SELECT unnest(?))`): DuckDB pushes the ids into
        # the scan, which reads only the row groups that may hold them. A literal IN list
        # pruned nothing on chunk_kv's composite key (7 ms at 1M), a UNION of one-id probes
        # planned slowly (2.9 ms); this took 1.2 ms. The links and their entries, and the
        # chunks and their sources, are two pairs of lookups run side by side.
        def links_and_entries(con) -> tuple[list, list]:
            links = con.execute(
                "SELECT chunk_id, token_ids, kv_key, span_start FROM chunk_kv "
                "WHERE chunk_id IN (SELECT unnest(?)) AND profile_id = ?",
                [ids, profile_id],
            ).fetchall()
            entries = con.execute(
                "SELECT kv_key, shard, tensor, num_tokens, dtype, checksum, nbytes FROM kv_entries "
                "WHERE kv_key IN (SELECT unnest(?))",
                [sorted({r[2] for r in links})],
            ).fetchall()
            return links, entries

        def chunks_and_sources(con) -> tuple[list, list]:
            chunks = con.execute(
                "SELECT chunk_id, doc_id, chunk_index, text, section, page_start, page_end FROM chunks "
                "WHERE chunk_id IN (SELECT unnest(?))",
                [ids],
            ).fetchall()
            sources = con.execute(
                "SELECT doc_id, source FROM documents WHERE doc_id IN (SELECT unnest(?))",
                [sorted({r[1] for r in chunks})],
            ).fetchall()
            return chunks, sources

        (link_rows, entry_rows), (chunks, source_rows) = self.catalog.side_by_side(
            links_and_entries, chunks_and_sources
        )
        links = {r[0]: r for r in link_rows}
        entries = {r[0]: EntryRow(*r) for r in entry_rows}
        sources = dict(source_rows)
        by_id = {}
        for chunk_id, doc_id, chunk_index, text, section, page_start, page_end in chunks:
            if doc_id not in sources:
                continue  # a chunk whose document is gone (the inner join this replaced left it out)
            link = links.get(chunk_id)
            by_id[chunk_id] = ContextRow(
                chunk_id,
                doc_id,
                sources[doc_id],
                chunk_index,
                text,
                tuple(link[1]) if link is not None and link[1] is not None else None,
                entries.get(link[2]) if link is not None else None,
                link[3] if link is not None else None,
                section=tuple(section or ()),
                pages=pages_of(page_start, page_end),
            )
        return [by_id[i] for i in chunk_ids if i in by_id]

    def _joined_rows(self, profile_id: str, chunk_ids: Sequence[int]) -> list[ContextRow]:
        """`context_rows` as one join over the tables."""
        rows = self.con.execute(
            """
            SELECT c.chunk_id, c.doc_id, d.source, c.chunk_index, c.text, k.token_ids,
                   e.kv_key, e.shard, e.tensor, e.num_tokens, e.dtype, e.checksum, e.nbytes, k.span_start,
                   c.section, c.page_start, c.page_end
            FROM chunks c JOIN documents d USING (doc_id)
            LEFT JOIN chunk_kv k ON k.chunk_id = c.chunk_id AND k.profile_id = ?
            LEFT JOIN kv_entries e ON e.kv_key = k.kv_key
            WHERE c.chunk_id IN (SELECT unnest(?))
            """,
            [profile_id, list(chunk_ids)],
        ).fetchall()
        by_id = {
            r[0]: ContextRow(
                r[0],
                r[1],
                r[2],
                r[3],
                r[4],
                tuple(r[5]) if r[5] is not None else None,
                EntryRow(*r[6:13]) if r[6] is not None else None,
                r[13],
                section=tuple(r[14] or ()),
                pages=pages_of(r[15], r[16]),
            )
            for r in rows
        }
        return [by_id[i] for i in chunk_ids if i in by_id]

    def stored_chunks(self, profile_id: str) -> list[tuple[str, int, list[int]]]:
        """Chunk KV stored on its own under `profile_id` (not in spans): `(kv_key, nbytes,
        chunk ids linked to it)`."""
        rows = self.con.execute(
            "SELECT k.kv_key, any_value(e.nbytes), list(k.chunk_id ORDER BY k.chunk_id) FROM chunk_kv k "
            "JOIN kv_entries e ON e.kv_key = k.kv_key WHERE k.profile_id = ? AND k.span_start IS NULL "
            "GROUP BY k.kv_key ORDER BY k.kv_key",
            [profile_id],
        ).fetchall()
        return [(r[0], int(r[1]), list(r[2])) for r in rows]

    def span_chunks(self, profile_id: str) -> list[SpanChunk]:
        """Every chunk linked into a span under `profile_id`, stored or not, span by span in
        chunk order (a span's chunks stay linked when the budget drops their KV: the link
        keeps the key the chunk's KV is learnt under)."""
        rows = self.con.execute(
            "SELECT k.chunk_id, c.doc_id, k.span_start, c.chunk_index, k.kv_key, e.nbytes FROM chunk_kv k "
            "JOIN chunks c USING (chunk_id) LEFT JOIN kv_entries e ON e.kv_key = k.kv_key "
            "WHERE k.profile_id = ? AND k.span_start IS NOT NULL ORDER BY c.doc_id, k.span_start, c.chunk_index",
            [profile_id],
        ).fetchall()
        return [
            SpanChunk(int(r[0]), r[1], int(r[2]), int(r[3]), r[4], None if r[5] is None else int(r[5])) for r in rows
        ]

    def evict(self, profile_id: str, kv_keys: Sequence[str]) -> None:
        """Drop the KV of `kv_keys` under `profile_id`: a chunk stored alone loses its link (the
        entry becomes dead: gc or reclaim drops it); a span's chunk keeps its link, and so its
        key and place in the span, while its entry row goes (its bytes are reclaimed with the
        dead). The budget evicts a span from its tail, so what stays is a usable prefix."""
        keys = list(kv_keys)
        self.catalog.delete_rows(
            "chunk_kv", "profile_id = ? AND span_start IS NULL AND kv_key IN (SELECT unnest(?))", [profile_id, keys]
        )
        self.catalog.delete_rows(
            "kv_entries",
            "kind = 'chunk' AND kv_key IN (SELECT unnest(?)) AND kv_key IN "
            "(SELECT kv_key FROM chunk_kv WHERE profile_id = ? AND span_start IS NOT NULL)",
            [keys, profile_id],
        )
