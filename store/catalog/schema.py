"""The catalog's schema: small named migrations applied in order on open (recorded in `meta`).
A catalog newer than this code is refused; a read-only open of an older one is told which
command migrates it."""

from __future__ import annotations

import json

from ragkv.errors import StoreFormatError
from ragkv.formats import __version__

FORMAT_VERSION = 1

MIGRATIONS: list[tuple[str, str]] = [
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


class Schema:
    """Applies the migrations a catalog lacks (mixed into `Catalog`)."""

    def _applied(self) -> list[str]:
        if self.delta:  # the base's migrations (a delta never changes them)
            row = self.con.execute("SELECT value FROM meta WHERE key = 'migrations'").fetchone()
            return json.loads(row[0]) if row else []
        has_meta = self.con.execute(
            "SELECT count(*) FROM information_schema.tables WHERE table_name = 'meta'"
        ).fetchone()[0]
        if not has_meta:
            return []
        row = self.con.execute("SELECT value FROM meta WHERE key = 'migrations'").fetchone()
        return json.loads(row[0]) if row else []

    def _migrate(self) -> None:
        applied = self._applied()
        known = [name for name, _ in MIGRATIONS]
        if applied != known[: len(applied)]:
            raise StoreFormatError(
                f"catalog {self.path} was written by a newer or different ragkv (migrations {applied}); this is "
                f"ragkv {__version__}: upgrade ragkv"
            )
        pending = MIGRATIONS[len(applied) :]
        if not pending:
            return
        if self.delta and not self.read_only:  # the base is shared and read-only: the writer compacts
            self.needs_compaction = True
            return
        if self.read_only:
            raise StoreFormatError(
                f"store catalog {self.path.name} needs schema migrations {[n for n, _ in pending]}; "
                "run one writing command (e.g. `ragkv gc`) to apply them"
            )
        with self.transaction():
            for name, sql in pending:
                self.con.execute(sql)
                applied.append(name)
            self._set_meta_rows({"migrations": json.dumps(applied), "format_version": str(FORMAT_VERSION)})
        self.migrated = True
