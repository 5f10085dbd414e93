"""The catalog's schema: small named migrations applied in order on open (recorded in `meta`).
A catalog newer than this code is refused; a read-only open of an older one is told which
command migrates it."""

from __future__ import annotations

import json

from ragkv.core.errors import StoreFormatError
from ragkv.core.formats import __version__
from ragkv.store.catalog.overlay import Overlay

FORMAT_VERSION = 1

_CHUNK_PLACES = {"chunks": {"section": "VARCHAR[]", "page_start": "INTEGER", "page_end": "INTEGER"}}
_PROFILE_CHECKS = {"profiles": {"kv_layout": "VARCHAR", "self_check": "VARCHAR"}}


def _add_columns(tables: dict[str, dict[str, str]]) -> str:
    """The SQL of a migration that only adds columns: {table: {column: type}}."""
    return "\n".join(
        f"ALTER TABLE {table} ADD COLUMN {column} {kind};"
        for table, columns in tables.items()
        for column, kind in columns.items()
    )


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
        # Popularity (see ragkv.store.kv.popularity): uses per (document, chunk index), and how far each
        # reader's hit log has been folded in.
        "0003_chunk_hits",
        """
        CREATE TABLE chunk_hits (
            doc_id VARCHAR, chunk_index INTEGER, hits BIGINT, misses BIGINT, uses BIGINT, score DOUBLE,
            last_use DOUBLE, PRIMARY KEY (doc_id, chunk_index));
        CREATE TABLE hit_files (name VARCHAR PRIMARY KEY, folded BIGINT);
        """,
    ),
    (
        # Where a chunk is in its document (ragkv.pipelines.reading.blocks): the deepest section holding it
        # (headings, outermost first) and the pages (or slides) it covers; NULL: none known.
        "0004_chunk_places",
        _add_columns(_CHUNK_PLACES),
    ),
    (
        # What a profile's cache holds per layer (ragkv.kv.layout.KVLayout.to_string) and the
        # self-test its first ingest ran (ragkv.model.self_check): NULL for profiles written before,
        # whose KV is of the plain layout (every layer full attention, one width).
        "0005_profile_checks",
        _add_columns(_PROFILE_CHECKS),
    ),
]
# Migrations that only add columns a reader can take as NULL: an older catalog missing only
# these is read as it is (its tables seen through views with the columns NULL), not refused.
ADDITIVE: dict[str, dict[str, dict[str, str]]] = {
    "0004_chunk_places": _CHUNK_PLACES,
    "0005_profile_checks": _PROFILE_CHECKS,
}


class Schema(Overlay):
    """Applies the migrations a catalog lacks (mixed into `Catalog`)."""

    def _applied(self) -> list[str]:
        if self.delta:  # the base's migrations (a delta never changes them)
            row = self.con.execute("SELECT value FROM meta WHERE key = 'migrations'").fetchone()
            return json.loads(row[0]) if row else []
        has_meta = self.value("SELECT count(*) FROM information_schema.tables WHERE table_name = 'meta'")
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
        if self.read_only and all(name in ADDITIVE for name, _ in pending):
            self._read_with_nulls([name for name, _ in pending])
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
            self.set_meta_rows({"migrations": json.dumps(applied), "format_version": str(FORMAT_VERSION)})
        self.migrated = True

    def _read_with_nulls(self, pending: list[str]) -> None:
        """Read an older catalog as it is: each table missing columns of the additive
        migrations `pending` is seen through a view that adds them as NULL."""
        added: dict[str, dict[str, str]] = {}
        for name in pending:
            for table, columns in ADDITIVE[name].items():
                added.setdefault(table, {}).update(columns)
        database = self.value("SELECT current_database()")
        for table, columns in added.items():
            nulls = ", ".join(f"NULL::{kind} AS {column}" for column, kind in columns.items())
            source = self.view_sql(table) if self.delta else f'SELECT * FROM "{database}".main.{table}'
            self.con.execute(f"CREATE OR REPLACE TEMP VIEW {table} AS SELECT *, {nulls} FROM ({source})")
