"""The DuckDB catalog: documents, chunks, model profiles and KV entries of one generation.

One `Catalog` object per open file: the connection, transactions, `meta`, the overlay (a
generation's delta over a shared base) and the schema's migrations, and its parts, one per
table family, each a small object of its own: `catalog.documents` (documents, chunks),
`catalog.entries` (profiles, KV entries, chunk links, spans), `catalog.usage` (popularity, the
KV budget), `catalog.reports` (totals) and `catalog.tombstones` (vectors deleted from the
segments). They return the small rows of `rows`.
"""

from __future__ import annotations

from pathlib import Path

import duckdb

from ragkv.core.errors import StoreFormatError
from ragkv.store.catalog.documents import Documents
from ragkv.store.catalog.entries import Entries
from ragkv.store.catalog.reports import Reports
from ragkv.store.catalog.rows import (
    ChunkLink,
    ChunkRow,
    ContextRow,
    DocumentRow,
    EntryRow,
    ProfileRow,
    ProfileTotals,
    SpanLink,
)
from ragkv.store.catalog.schema import FORMAT_VERSION, Schema
from ragkv.store.catalog.tombstones import Tombstones
from ragkv.store.catalog.usage import Usage

__all__ = [
    "FORMAT_VERSION",
    "Catalog",
    "ChunkLink",
    "ChunkRow",
    "ContextRow",
    "DocumentRow",
    "EntryRow",
    "ProfileRow",
    "ProfileTotals",
    "SpanLink",
]


class Catalog(Schema):
    """One catalog file, plain or a delta over a base (see `overlay`). Open read-only for
    queries, or writable inside a store write."""

    def __init__(self, path: Path, read_only: bool):
        self.path = path
        self.read_only = read_only
        try:
            self.con = duckdb.connect(str(path), read_only=read_only)
        except duckdb.Error as exc:
            raise StoreFormatError(f"cannot open catalog {path}: {exc}".splitlines()[0]) from exc
        self.migrated = False  # whether opening applied schema migrations (a change to publish)
        self.needs_compaction = False  # a delta over a base of an older schema: compact to migrate
        try:
            if self._is_delta_file():
                self._attach_base()
            self._migrate()
        except BaseException:
            self.con.close()
            raise
        self.documents = Documents(self)
        self.entries = Entries(self)
        self.usage = Usage(self)
        self.reports = Reports(self)
        self.tombstones = Tombstones(self)

    def fingerprint(self) -> tuple:
        """Row count and an order-independent hash of the rows of every table of this file (of
        a delta: its own tables, the base never changes): equal before and after a write means
        the write changed nothing (and there is nothing to publish)."""
        tables = self.con.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = 'main' "
            "AND table_type = 'BASE TABLE' AND table_catalog = current_database() "
            "ORDER BY table_name"
        ).fetchall()
        counts = {
            name: self.con.execute(f'SELECT count(*), coalesce(sum(hash(t)), 0) FROM "{name}" t').fetchone()
            for (name,) in tables
        }
        return tuple((name, *(row or ())) for name, row in counts.items())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def set_meta(self, values: dict[str, str]) -> None:
        with self.transaction():
            self.set_meta_rows(values)
