"""The DuckDB catalog: documents, chunks, model profiles and KV entries of one generation.

One `Catalog` object per open file, its methods grouped by table family: `schema` (migrations),
`documents` (documents, chunks), `entries` (profiles, KV entries, chunk links, spans), `usage`
(popularity, the KV budget) and `reports` (totals). It returns the small rows of `rows`.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import duckdb
import pyarrow as pa

from ragkv.errors import StoreFormatError
from store.catalog.documents import Documents
from store.catalog.entries import Entries
from store.catalog.overlay import Overlay
from store.catalog.reports import Reports
from store.catalog.rows import (
    ChunkLink,
    ChunkRow,
    ContextRow,
    DocumentRow,
    EntryRow,
    ProfileRow,
    ProfileTotals,
    SpanLink,
)
from store.catalog.schema import FORMAT_VERSION, Schema
from store.catalog.usage import Usage

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


class Catalog(Overlay, Schema, Documents, Entries, Usage, Reports):
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

    def meta(self) -> dict[str, str]:
        return dict(self.con.execute("SELECT key, value FROM meta").fetchall())

    def set_meta(self, values: dict[str, str]) -> None:
        with self.transaction():
            self._set_meta_rows(values)

    def _set_meta_rows(self, values: dict[str, str]) -> None:
        rows = pa.table({"key": list(values), "value": [str(v) for v in values.values()]})
        self._insert("meta", rows, replace=True)
