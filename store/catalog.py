"""The DuckDB catalog: documents, chunks, model profiles and KV entries of one generation.

Schema changes are small named migrations applied in order on open (recorded in `meta`);
a catalog newer than this code is refused.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import duckdb
import pyarrow as pa

from ragkv.errors import StoreFormatError
from store.popularity import HALF_LIFE_S, ChunkHits, Pending, decay, tally
from store.shards import SealedEntry

FORMAT_VERSION = 1

_MIGRATIONS: list[tuple[str, str]] = [
    (
        "0001_initial",
        """
        CREATE TABLE meta (key VARCHAR PRIMARY KEY, value VARCHAR NOT NULL);
        CREATE TABLE profiles (
            profile_id VARCHAR PRIMARY KEY, model_name VARCHAR, model_fingerprint VARCHAR,
            tokenizer_fingerprint VARCHAR, template_fingerprint VARCHAR, system_prompt VARCHAR,
            prefix_ids INTEGER[], dtype VARCHAR, kv_quant VARCHAR, num_layers INTEGER,
            num_kv_heads INTEGER, head_dim INTEGER, created_at TIMESTAMP DEFAULT current_timestamp);
        CREATE TABLE documents (
            doc_id VARCHAR PRIMARY KEY, source VARCHAR, content_hash VARCHAR, chunking VARCHAR,
            num_chunks INTEGER, metadata VARCHAR, ingested_at TIMESTAMP DEFAULT current_timestamp);
        CREATE TABLE chunks (
            chunk_id BIGINT PRIMARY KEY, doc_id VARCHAR, chunk_index INTEGER, text VARCHAR);
        CREATE TABLE kv_entries (
            kv_key VARCHAR PRIMARY KEY, profile_id VARCHAR, kind VARCHAR, shard VARCHAR,
            tensor VARCHAR, num_tokens INTEGER, dtype VARCHAR, nbytes BIGINT, checksum VARCHAR,
            created_at TIMESTAMP DEFAULT current_timestamp);
        CREATE TABLE chunk_kv (
            chunk_id BIGINT, profile_id VARCHAR, kv_key VARCHAR, token_ids INTEGER[],
            PRIMARY KEY (chunk_id, profile_id));
        """,
    ),
    (
        # A chunk whose KV continues a span of its document: the chunk_index the span starts at
        # (NULL: the chunk's KV was computed on its own, right after the prefix).
        "0002_chunk_spans",
        "ALTER TABLE chunk_kv ADD COLUMN span_start INTEGER;",
    ),
    (
        # Popularity (see store.popularity): uses per (document, chunk index), and how far each
        # reader's hit log has been folded in.
        "0003_chunk_hits",
        """
        CREATE TABLE chunk_hits (
            doc_id VARCHAR, chunk_index INTEGER, hits BIGINT, misses BIGINT, uses BIGINT, score DOUBLE,
            last_use DOUBLE, PRIMARY KEY (doc_id, chunk_index));
        CREATE TABLE hit_files (name VARCHAR PRIMARY KEY, folded BIGINT);
        """,
    ),
]


_ENTRY_COLUMNS = "e.kv_key, e.shard, e.tensor, e.num_tokens, e.dtype, e.checksum, e.nbytes"


@dataclass(frozen=True)
class DocumentRow:
    doc_id: str
    source: str
    content_hash: str
    chunking: str  # chunker identity and settings the chunks were cut with
    num_chunks: int


@dataclass(frozen=True)
class ChunkRow:
    chunk_id: int
    doc_id: str
    chunk_index: int
    text: str


@dataclass(frozen=True)
class EntryRow:
    """A KV entry's location and checksum."""

    kv_key: str
    shard: str
    tensor: str
    num_tokens: int
    dtype: str
    checksum: str
    nbytes: int


@dataclass(frozen=True)
class ContextRow:
    """A retrieved chunk with its source and, under one profile, its token ids and KV entry."""

    chunk_id: int
    doc_id: str
    source: str
    chunk_index: int
    text: str
    token_ids: tuple[int, ...] | None  # None: no KV computed for this profile
    entry: EntryRow | None
    span_start: int | None = None  # chunk_index its span starts at; None: its KV stands alone
    live: bool = False  # a passage given as text, not from the store: always prefilled, never stored

    @property
    def starts_span(self) -> bool:
        """Whether this chunk's KV was computed right after the prefix (loadable on its own)."""
        return self.span_start is None or self.span_start == self.chunk_index


class Catalog:
    """One catalog file. Open read-only for queries, or writable inside a store write."""

    def __init__(self, path: Path, read_only: bool):
        self.path = path
        self.read_only = read_only
        try:
            self.con = duckdb.connect(str(path), read_only=read_only)
        except duckdb.Error as exc:
            raise StoreFormatError(f"cannot open catalog {path}: {exc}".splitlines()[0]) from exc
        self.migrated = False  # whether opening applied schema migrations (a change to publish)
        self._migrate()

    # -- schema ---------------------------------------------------------------------------
    def _applied(self) -> list[str]:
        has_meta = self.con.execute(
            "SELECT count(*) FROM information_schema.tables WHERE table_name = 'meta'"
        ).fetchone()[0]
        if not has_meta:
            return []
        row = self.con.execute("SELECT value FROM meta WHERE key = 'migrations'").fetchone()
        return json.loads(row[0]) if row else []

    def _migrate(self) -> None:
        applied = self._applied()
        known = [name for name, _ in _MIGRATIONS]
        if applied != known[: len(applied)]:
            raise StoreFormatError(
                f"catalog {self.path} was written by a newer or different ragkv (migrations {applied}); upgrade ragkv"
            )
        pending = _MIGRATIONS[len(applied):]
        if not pending:
            return
        if self.read_only:
            raise StoreFormatError(
                f"store catalog {self.path.name} needs schema migrations {[n for n, _ in pending]}; "
                "run one writing command (e.g. `ragkv gc`) to apply them")
        with self.transaction():
            for name, sql in pending:
                self.con.execute(sql)
                applied.append(name)
            self._set_meta_rows({"migrations": json.dumps(applied), "format_version": str(FORMAT_VERSION)})
        self.migrated = True

    def fingerprint(self) -> tuple:
        """Row count and an order-independent hash of the rows of every table: equal before
        and after a write means the write changed nothing (and there is nothing to publish)."""
        tables = self.con.execute("SELECT table_name FROM information_schema.tables WHERE table_schema = 'main' "
                                  "AND table_type = 'BASE TABLE' ORDER BY table_name").fetchall()
        return tuple((name, *self.con.execute(f'SELECT count(*), coalesce(sum(hash(t)), 0) FROM "{name}" t').fetchone())
                     for (name,) in tables)

    @contextmanager
    def transaction(self):
        self.con.execute("BEGIN TRANSACTION")
        try:
            yield
        except BaseException:
            self.con.execute("ROLLBACK")
            raise
        self.con.execute("COMMIT")

    def close(self) -> None:
        if not self.read_only:
            self.con.execute("CHECKPOINT")
        self.con.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- meta -----------------------------------------------------------------------------
    def meta(self) -> dict[str, str]:
        return dict(self.con.execute("SELECT key, value FROM meta").fetchall())

    def set_meta(self, values: dict[str, str]) -> None:
        with self.transaction():
            self._set_meta_rows(values)

    def _set_meta_rows(self, values: dict[str, str]) -> None:
        for key, value in values.items():
            self.con.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", [key, value])

    # -- profiles -------------------------------------------------------------------------
    def add_profile(self, row: dict) -> None:
        """Insert a profile row (columns as in the schema) unless its id is already present."""
        exists = self.con.execute("SELECT 1 FROM profiles WHERE profile_id = ?", [row["profile_id"]]).fetchone()
        if not exists:
            columns = ", ".join(row)
            marks = ", ".join("?" for _ in row)
            self.con.execute(f"INSERT INTO profiles ({columns}) VALUES ({marks})", list(row.values()))

    def profiles(self) -> list[dict]:
        """Profile rows, newest first."""
        cursor = self.con.execute("SELECT * FROM profiles ORDER BY created_at DESC")
        names = [d[0] for d in cursor.description]
        return [dict(zip(names, row)) for row in cursor.fetchall()]

    # -- documents and chunks -------------------------------------------------------------
    def documents(self) -> dict[str, DocumentRow]:
        rows = self.con.execute("SELECT doc_id, source, content_hash, chunking, num_chunks FROM documents").fetchall()
        return {row[0]: DocumentRow(*row) for row in rows}

    def chunks_of(self, doc_ids: Iterable[str]) -> list[ChunkRow]:
        ids = list(doc_ids)
        if not ids:
            return []
        rows = self.con.execute(
            "SELECT chunk_id, doc_id, chunk_index, text FROM chunks WHERE doc_id IN (SELECT unnest(?)) "
            "ORDER BY doc_id, chunk_index",
            [ids],
        ).fetchall()
        return [ChunkRow(*row) for row in rows]

    def next_chunk_id(self) -> int:
        return self.con.execute("SELECT coalesce(max(chunk_id), -1) + 1 FROM chunks").fetchone()[0]

    def delete_documents(self, doc_ids: Sequence[str]) -> list[int]:
        """Remove documents with their chunks and chunk-to-KV links; returns the chunk ids removed.
        KV entries stay (other chunks or profiles may share them); garbage collection drops them."""
        if not doc_ids:
            return []
        ids = list(doc_ids)
        chunk_ids = [r[0] for r in self.con.execute(
            "SELECT chunk_id FROM chunks WHERE doc_id IN (SELECT unnest(?))", [ids]).fetchall()]
        self.con.execute("DELETE FROM chunk_kv WHERE chunk_id IN (SELECT unnest(?))", [chunk_ids])
        self.con.execute("DELETE FROM chunks WHERE doc_id IN (SELECT unnest(?))", [ids])
        self.con.execute("DELETE FROM documents WHERE doc_id IN (SELECT unnest(?))", [ids])
        return chunk_ids

    def add_documents(self, documents: Sequence[DocumentRow], metadata: Sequence[dict], chunks: Sequence[ChunkRow]) -> None:
        new_docs = pa.table({
            "doc_id": [d.doc_id for d in documents],
            "source": [d.source for d in documents],
            "content_hash": [d.content_hash for d in documents],
            "chunking": [d.chunking for d in documents],
            "num_chunks": pa.array([d.num_chunks for d in documents], pa.int32()),
            "metadata": [json.dumps(m, sort_keys=True) for m in metadata],
        })
        new_chunks = pa.table({
            "chunk_id": pa.array([c.chunk_id for c in chunks], pa.int64()),
            "doc_id": [c.doc_id for c in chunks],
            "chunk_index": pa.array([c.chunk_index for c in chunks], pa.int32()),
            "text": [c.text for c in chunks],
        })
        self.con.execute("INSERT INTO documents (doc_id, source, content_hash, chunking, num_chunks, metadata) "
                         "SELECT * FROM new_docs")
        self.con.execute("INSERT INTO chunks SELECT * FROM new_chunks")

    # -- KV entries -----------------------------------------------------------------------
    def add_entries(self, profile_id: str, entries: Sequence[SealedEntry], prefix_keys: set[str] = frozenset()) -> None:
        """Commit rows for entries of sealed shards (one transaction). Entries named in
        `prefix_keys` are the shared prefix KV; the rest are chunks."""
        if not entries:
            return
        new_entries = pa.table({
            "kv_key": [e.name for e in entries],
            "profile_id": [profile_id] * len(entries),
            "kind": ["prefix" if e.name in prefix_keys else "chunk" for e in entries],
            "shard": [e.shard for e in entries],
            "tensor": [e.name for e in entries],
            "num_tokens": pa.array([e.num_tokens for e in entries], pa.int32()),
            "dtype": [e.dtype for e in entries],
            "nbytes": pa.array([e.nbytes for e in entries], pa.int64()),
            "checksum": [e.checksum for e in entries],
        })
        with self.transaction():
            self.con.execute(
                "INSERT INTO kv_entries (kv_key, profile_id, kind, shard, tensor, num_tokens, dtype, nbytes, checksum) "
                "SELECT * FROM new_entries WHERE kv_key NOT IN (SELECT kv_key FROM kv_entries)"
            )

    def existing_keys(self, keys: Iterable[str]) -> set[str]:
        wanted = list(keys)
        if not wanted:
            return set()
        rows = self.con.execute("SELECT kv_key FROM kv_entries WHERE kv_key IN (SELECT unnest(?))", [wanted]).fetchall()
        return {r[0] for r in rows}

    def entry(self, kv_key: str) -> EntryRow | None:
        row = self.con.execute(f"SELECT {_ENTRY_COLUMNS} FROM kv_entries e WHERE kv_key = ?", [kv_key]).fetchone()
        return EntryRow(*row) if row else None

    def link_chunks(self, profile_id: str, links: Sequence[tuple]) -> None:
        """Record, for each `(chunk_id, kv_key, token_ids[, span_start])`, which KV entry holds
        that chunk under `profile_id` (span_start: the chunk_index of the span its KV continues,
        None when computed on its own)."""
        new_links = pa.table({
            "chunk_id": pa.array([link[0] for link in links], pa.int64()),
            "profile_id": [profile_id] * len(links),
            "kv_key": [link[1] for link in links],
            "token_ids": pa.array([list(link[2]) for link in links], pa.list_(pa.int32())),
            "span_start": pa.array([link[3] if len(link) > 3 else None for link in links], pa.int32()),
        })
        self.con.execute("DELETE FROM chunk_kv WHERE profile_id = ? AND chunk_id IN (SELECT chunk_id FROM new_links)",
                         [profile_id])
        self.con.execute("INSERT INTO chunk_kv SELECT chunk_id, profile_id, kv_key, token_ids, span_start FROM new_links")

    def span_chunk_ids(self, profile_id: str, doc_id: str, span_start: int) -> list[int]:
        """Chunk ids of the span of `doc_id` that starts at chunk_index `span_start`, in order."""
        rows = self.con.execute(
            "SELECT c.chunk_id FROM chunks c JOIN chunk_kv k USING (chunk_id) WHERE k.profile_id = ? AND c.doc_id = ? "
            "AND coalesce(k.span_start, c.chunk_index) = ? AND c.chunk_index >= ? ORDER BY c.chunk_index",
            [profile_id, doc_id, span_start, span_start]).fetchall()
        return [r[0] for r in rows]

    def span_links(self, kv_key: str) -> list[tuple[str, tuple[int, ...]]]:
        """`(kv_key, token_ids)` of every chunk in the span holding `kv_key`, in order (one
        pair for a chunk whose KV stands alone; empty when no chunk links to the key)."""
        rows = self.con.execute(
            """
            WITH target AS (
                SELECT k.profile_id, c.doc_id, coalesce(k.span_start, c.chunk_index) AS start, k.span_start
                FROM chunk_kv k JOIN chunks c USING (chunk_id) WHERE k.kv_key = ? LIMIT 1)
            SELECT k.kv_key, k.token_ids FROM chunk_kv k JOIN chunks c USING (chunk_id), target t
            WHERE k.profile_id = t.profile_id AND c.doc_id = t.doc_id
              AND ((t.span_start IS NULL AND k.kv_key = ?) OR (t.span_start IS NOT NULL AND k.span_start = t.start))
            ORDER BY c.chunk_index
            """, [kv_key, kv_key]).fetchall()
        return [(r[0], tuple(r[1])) for r in rows]

    def linked_totals(self, profile_id: str, doc_ids: Sequence[str]) -> tuple[int, int]:
        """(chunks, tokens) of `doc_ids` that already have KV under `profile_id`."""
        row = self.con.execute(
            "SELECT count(*), coalesce(sum(len(k.token_ids)), 0) FROM chunk_kv k JOIN chunks c USING (chunk_id) "
            "WHERE k.profile_id = ? AND c.doc_id IN (SELECT unnest(?))",
            [profile_id, list(doc_ids)],
        ).fetchone()
        return int(row[0]), int(row[1])

    def linked_chunk_ids(self, profile_id: str) -> set[int]:
        rows = self.con.execute("SELECT chunk_id FROM chunk_kv WHERE profile_id = ?", [profile_id]).fetchall()
        return {r[0] for r in rows}

    # -- maintenance (gc, verify, repair) -------------------------------------------------
    def drop_profiles(self, profile_ids: Sequence[str]) -> None:
        """Forget profiles with their chunk links and KV entry rows (files stay until gc)."""
        ids = list(profile_ids)
        for table in ("chunk_kv", "kv_entries", "profiles"):
            self.con.execute(f"DELETE FROM {table} WHERE profile_id IN (SELECT unnest(?))", [ids])

    def dead_entries(self) -> list[EntryRow]:
        """Entries nothing needs: chunk KV no chunk links to; prefix KV of dropped profiles, or
        of every profile once the store holds no chunks. (A profile may link no chunk and still
        need its prefix: under a KV budget, chunks get KV on their first question.)"""
        rows = self.con.execute(f"""
            SELECT {_ENTRY_COLUMNS} FROM kv_entries e
            WHERE (e.kind = 'chunk' AND e.kv_key NOT IN (SELECT kv_key FROM chunk_kv))
               OR (e.kind = 'prefix' AND (e.profile_id NOT IN (SELECT profile_id FROM profiles)
                                          OR NOT EXISTS (SELECT 1 FROM chunks)))
            ORDER BY e.shard""").fetchall()
        return [EntryRow(*r) for r in rows]

    def delete_entries(self, kv_keys: Iterable[str]) -> None:
        self.con.execute("DELETE FROM kv_entries WHERE kv_key IN (SELECT unnest(?))", [list(kv_keys)])

    def move_entries(self, sealed: Sequence[SealedEntry]) -> None:
        """Point existing entry rows at the shards their bytes were copied into."""
        with self.transaction():
            for entry in sealed:
                self.con.execute("UPDATE kv_entries SET shard = ?, tensor = ? WHERE kv_key = ?",
                                 [entry.shard, entry.name, entry.name])

    def entries_in(self, shard: str) -> list[EntryRow]:
        rows = self.con.execute(f"SELECT {_ENTRY_COLUMNS} FROM kv_entries e WHERE shard = ?", [shard]).fetchall()
        return [EntryRow(*r) for r in rows]

    def live_bytes_by_shard(self) -> dict[str, int]:
        return dict(self.con.execute("SELECT shard, sum(nbytes) FROM kv_entries GROUP BY shard").fetchall())

    def linked_token_ids(self, chunk_id: int, profile_id: str) -> tuple[int, ...] | None:
        """The token ids a chunk is linked with under `profile_id` (None: not linked)."""
        row = self.con.execute("SELECT token_ids FROM chunk_kv WHERE chunk_id = ? AND profile_id = ?",
                               [chunk_id, profile_id]).fetchone()
        return tuple(row[0]) if row else None

    def deferred_chunks(self, profile_id: str) -> list[tuple[int, str]]:
        """(chunk_id, text) of the chunks without KV under `profile_id` (deferred by a budget or
        --precompute: not linked to an entry), in chunk order."""
        return self.con.execute(
            "SELECT chunk_id, text FROM chunks WHERE chunk_id NOT IN "
            "(SELECT chunk_id FROM chunk_kv WHERE profile_id = ? AND kv_key IN (SELECT kv_key FROM kv_entries)) "
            "ORDER BY chunk_id", [profile_id]).fetchall()

    def links_without_entries(self) -> list[tuple[int, str, str]]:
        """(chunk_id, profile_id, kv_key) of chunk links whose KV entry row is missing."""
        return self.con.execute(
            "SELECT chunk_id, profile_id, kv_key FROM chunk_kv WHERE kv_key NOT IN (SELECT kv_key FROM kv_entries) "
            "ORDER BY chunk_id").fetchall()

    def token_ids_of(self, kv_key: str) -> tuple[int, ...] | None:
        """The chunk token ids an entry's key was made from (any chunk linked to it)."""
        row = self.con.execute("SELECT token_ids FROM chunk_kv WHERE kv_key = ? LIMIT 1", [kv_key]).fetchone()
        return tuple(row[0]) if row else None

    def chunk_texts(self, chunk_ids: Sequence[int]) -> dict[int, str]:
        rows = self.con.execute("SELECT chunk_id, text FROM chunks WHERE chunk_id IN (SELECT unnest(?))",
                                [list(chunk_ids)]).fetchall()
        return dict(rows)

    def chunk_refs(self, chunk_ids: Sequence[int]) -> dict[int, tuple[str, int, str]]:
        """`{chunk_id: (doc_id, chunk_index, text)}` of those of `chunk_ids` the store holds."""
        rows = self.con.execute("SELECT chunk_id, doc_id, chunk_index, text FROM chunks "
                                "WHERE chunk_id IN (SELECT unnest(?))", [list(chunk_ids)]).fetchall()
        return {r[0]: (r[1], r[2], r[3]) for r in rows}

    def chunk_ids_of(self, doc_id: str) -> list[int]:
        return [r[0] for r in self.con.execute("SELECT chunk_id FROM chunks WHERE doc_id = ? ORDER BY chunk_index",
                                               [doc_id]).fetchall()]

    def chunk_ids(self) -> set[int]:
        return {r[0] for r in self.con.execute("SELECT chunk_id FROM chunks").fetchall()}

    def linked_profiles(self) -> set[str]:
        return {r[0] for r in self.con.execute("SELECT DISTINCT profile_id FROM chunk_kv").fetchall()}

    def profile_totals(self) -> list[dict]:
        """Per profile: model, dtype, entries, bytes, chunks linked and their tokens."""
        cursor = self.con.execute("""
            SELECT p.profile_id, p.model_name, p.dtype, p.kv_quant,
                   (SELECT count(*) FROM kv_entries e WHERE e.profile_id = p.profile_id) AS entries,
                   (SELECT coalesce(sum(nbytes), 0) FROM kv_entries e WHERE e.profile_id = p.profile_id) AS kv_bytes,
                   (SELECT count(*) FROM chunk_kv k WHERE k.profile_id = p.profile_id) AS chunks,
                   (SELECT coalesce(sum(len(token_ids)), 0) FROM chunk_kv k WHERE k.profile_id = p.profile_id) AS tokens
            FROM profiles p ORDER BY p.created_at DESC""")
        names = [d[0] for d in cursor.description]
        return [dict(zip(names, row)) for row in cursor.fetchall()]

    # -- popularity and the KV budget ---------------------------------------------------------
    def kv_budget(self) -> int | None:
        """Bytes of KV the store may hold (None: no budget)."""
        value = self.meta().get("kv_budget")
        return int(value) if value else None

    def half_life_s(self) -> float:
        """Seconds for a chunk's popularity to halve without uses (the `half_life_s` setting)."""
        return float(self.meta().get("half_life_s") or HALF_LIFE_S)

    def folded_offsets(self) -> dict[str, int]:
        return dict(self.con.execute("SELECT name, folded FROM hit_files").fetchall())

    def fold_uses(self, pending: Pending, half_life_s: float) -> int:
        """Add `pending` uses to `chunk_hits`, record the offsets they end at, and forget the
        files `pending` found finished. Returns the number of uses folded."""
        keys = {(u.doc_id, u.chunk_index) for u in pending.uses}
        rows = self.chunk_hits(keys)
        changed = tally(rows, pending.uses, half_life_s)
        new_hits = pa.table({
            "doc_id": [k[0] for k in changed], "chunk_index": pa.array([k[1] for k in changed], pa.int32()),
            "hits": pa.array([rows[k].hits for k in changed], pa.int64()),
            "misses": pa.array([rows[k].misses for k in changed], pa.int64()),
            "uses": pa.array([rows[k].uses for k in changed], pa.int64()),
            "score": pa.array([rows[k].score for k in changed], pa.float64()),
            "last_use": pa.array([rows[k].last_use for k in changed], pa.float64()),
        })
        offsets = pa.table({"name": list(pending.offsets), "folded": pa.array(list(pending.offsets.values()), pa.int64())})
        with self.transaction():
            self.con.execute("INSERT OR REPLACE INTO chunk_hits SELECT * FROM new_hits")
            self.con.execute("INSERT OR REPLACE INTO hit_files SELECT * FROM offsets")
            self.con.execute("DELETE FROM hit_files WHERE name IN (SELECT unnest(?))", [pending.finished])
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
            wanted_keys = pa.table({"doc_id": [k[0] for k in wanted],
                                    "chunk_index": pa.array([k[1] for k in wanted], pa.int32())})
            rows = self.con.execute(sql + " JOIN wanted_keys USING (doc_id, chunk_index)").fetchall()
        return {(r[0], r[1]): ChunkHits(*r[2:]) for r in rows}

    def chunk_scores(self, chunk_ids: Sequence[int], now: float, half_life_s: float) -> dict[int, float]:
        """Each chunk's popularity score as of `now` (0 for a chunk never used)."""
        rows = self.con.execute(
            "SELECT c.chunk_id, h.score, h.last_use FROM chunks c JOIN chunk_hits h USING (doc_id, chunk_index) "
            "WHERE c.chunk_id IN (SELECT unnest(?))", [list(chunk_ids)]).fetchall()
        scores = {r[0]: decay(r[1], r[2], now, half_life_s) for r in rows}
        return {i: scores.get(i, 0.0) for i in chunk_ids}

    def stored_chunks(self, profile_id: str) -> list[tuple[str, int, list[int]]]:
        """Chunk KV the budget may evict under `profile_id` (chunks stored on their own, not
        spans): `(kv_key, nbytes, chunk ids linked to it)`."""
        rows = self.con.execute(
            "SELECT k.kv_key, any_value(e.nbytes), list(k.chunk_id ORDER BY k.chunk_id) FROM chunk_kv k "
            "JOIN kv_entries e ON e.kv_key = k.kv_key WHERE k.profile_id = ? AND k.span_start IS NULL "
            "GROUP BY k.kv_key ORDER BY k.kv_key", [profile_id]).fetchall()
        return [(r[0], int(r[1]), list(r[2])) for r in rows]

    def unlink_keys(self, profile_id: str, kv_keys: Sequence[str]) -> None:
        """Drop the chunk links to `kv_keys` (their entries become dead: gc or reclaim drops them)."""
        self.con.execute("DELETE FROM chunk_kv WHERE profile_id = ? AND kv_key IN (SELECT unnest(?))",
                         [profile_id, list(kv_keys)])

    def document_uses(self) -> list[dict]:
        """Per stored document: uses, hits, misses and summed score (as last folded)."""
        cursor = self.con.execute("""
            SELECT d.doc_id, coalesce(sum(h.uses), 0) AS uses, coalesce(sum(h.hits), 0) AS hits,
                   coalesce(sum(h.misses), 0) AS misses, coalesce(sum(h.score), 0) AS score,
                   coalesce(max(h.last_use), 0) AS last_use
            FROM documents d LEFT JOIN chunk_hits h USING (doc_id) GROUP BY d.doc_id""")
        names = [d[0] for d in cursor.description]
        return [dict(zip(names, row)) for row in cursor.fetchall()]

    # -- the query path -------------------------------------------------------------------
    def context_rows(self, profile_id: str, chunk_ids: Sequence[int]) -> list[ContextRow]:
        """Rows for `chunk_ids`, in that order, joined with their source and their KV entry."""
        if not chunk_ids:
            return []
        rows = self.con.execute(
            """
            SELECT c.chunk_id, c.doc_id, d.source, c.chunk_index, c.text, k.token_ids,
                   e.kv_key, e.shard, e.tensor, e.num_tokens, e.dtype, e.checksum, e.nbytes, k.span_start
            FROM chunks c JOIN documents d USING (doc_id)
            LEFT JOIN chunk_kv k ON k.chunk_id = c.chunk_id AND k.profile_id = ?
            LEFT JOIN kv_entries e ON e.kv_key = k.kv_key
            WHERE c.chunk_id IN (SELECT unnest(?))
            """,
            [profile_id, list(chunk_ids)],
        ).fetchall()
        by_id = {}
        for r in rows:
            entry = EntryRow(*r[6:13]) if r[6] is not None else None
            token_ids = tuple(r[5]) if r[5] is not None else None
            by_id[r[0]] = ContextRow(r[0], r[1], r[2], r[3], r[4], token_ids, entry, r[13])
        return [by_id[i] for i in chunk_ids if i in by_id]

    def shards(self) -> set[str]:
        """Shard files this catalog references."""
        return {r[0] for r in self.con.execute("SELECT DISTINCT shard FROM kv_entries").fetchall()}

    def counts(self) -> dict[str, int]:
        tables = ("documents", "chunks", "kv_entries", "profiles")
        return {t: self.con.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in tables}

    def prefix_bytes(self) -> int:
        """Bytes of the system-prompt KV entries (of every profile): what no budget evicts."""
        return self.con.execute("SELECT coalesce(sum(nbytes), 0) FROM kv_entries WHERE kind = 'prefix'").fetchone()[0]

    def kv_bytes(self) -> int:
        return self.con.execute("SELECT coalesce(sum(nbytes), 0) FROM kv_entries").fetchone()[0]

    def all_entries(self) -> list[EntryRow]:
        rows = self.con.execute(f"SELECT {_ENTRY_COLUMNS} FROM kv_entries e ORDER BY shard, tensor").fetchall()
        return [EntryRow(*r) for r in rows]
