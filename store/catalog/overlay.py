"""A generation's catalog as a small delta over a shared, immutable base (mixed into `Catalog`).

A base (`base-N.duckdb`) is a whole catalog in the plain format: the tables of `schema`. A
generation's own file (`catalog-N.duckdb`) is a delta: for every table `t`, `add_t` holds the
rows added or replaced since the base and `del_t` the keys of base rows deleted or replaced.
Opening the delta attaches the base read-only and defines a temporary view `t` for each table
(the base's rows less `del_t`, plus `add_t`), so every query reads the tables by their plain
names. Writes go through `insert_rows` / `delete_rows`, which keep the delta's two halves consistent.

A writer copies the previous delta (small: the changes since the last compaction), never the
base; `compact_into` writes the views out as a new base once the delta outgrows its share.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import duckdb
import pyarrow as pa

from ragkv.core.errors import StoreFormatError

# Every table with the columns that identify a row.
TABLE_KEYS: dict[str, tuple[str, ...]] = {
    "meta": ("key",),
    "profiles": ("profile_id",),
    "documents": ("doc_id",),
    "chunks": ("chunk_id",),
    "kv_entries": ("kv_key",),
    "chunk_kv": ("chunk_id", "profile_id"),
    "chunk_hits": ("doc_id", "chunk_index"),
    "hit_files": ("name",),
}
# A base's row groups (DuckDB's default: 122,880 rows). A point lookup reads every row group
# its keys' zone maps do not rule out; with the rows sorted by key, a question's five chunk ids
# touch five groups, so smaller groups read less: at 1M chunks the chunk-link lookup took 2.3 ms
# with the default, 1.2 ms with 8,192 rows, for a file about a fifth larger.
BASE_ROW_GROUP = 8192
A = TypeVar("A")
B = TypeVar("B")
DELTA_INFO = "delta_info"  # (key, value): the base this delta is over
GONE_VECTORS = "vector_gone"  # chunk ids removed from the vector segments (tombstones)


def _on(table: str, left: str, right: str) -> str:
    return " AND ".join(f"{left}.{k} = {right}.{k}" for k in TABLE_KEYS[table])


class Overlay:
    """Mixed into `Catalog`, which opens `con` on the file at `path`."""

    con: duckdb.DuckDBPyConnection
    path: Path
    read_only: bool
    delta = False  # whether this catalog is a delta over a base (else: a plain, whole catalog)
    _side: tuple[duckdb.DuckDBPyConnection, ThreadPoolExecutor] | None = None  # see `side_by_side`

    def one(self, sql: str, params: list | None = None) -> tuple[Any, ...]:
        """The one row `sql` gives (an aggregate: a count, a sum; a setting that is there)."""
        row = self.con.execute(sql, params or []).fetchone()
        assert row is not None, sql
        return row

    def value(self, sql: str, params: list | None = None) -> Any:
        """The first column of `one`'s row."""
        return self.one(sql, params)[0]

    def close(self) -> None:
        if self._side is not None:
            self._side[1].shutdown()
            self._side[0].close()
            self._side = None
        if not self.read_only:
            self.con.execute("CHECKPOINT")
        self.con.close()

    def side_by_side(
        self, first: Callable[[duckdb.DuckDBPyConnection], A], second: Callable[[duckdb.DuckDBPyConnection], B]
    ) -> tuple[A, B]:
        """`first(connection)` and `second(connection)`, run at once on a reader: `first` on a
        second connection to the same database, in a thread of its own (DuckDB lets go of the
        GIL while a query runs), `second` on this one. A point lookup is mostly DuckDB's fixed
        cost per query, so two at once take little more than one. A writer runs them in turn."""
        if not self.read_only:
            return first(self.con), second(self.con)
        if self._side is None:
            side = self.con.cursor()  # the same database, but without this connection's views
            if self.delta:
                self._define_views(side)
            self._side = (side, ThreadPoolExecutor(1, thread_name_prefix="ragkv-catalog"))
        side, worker = self._side
        future = worker.submit(first, side)
        try:
            second_result = second(self.con)
        finally:
            first_result = future.result()
        return first_result, second_result

    @contextmanager
    def transaction(self):
        self.con.execute("BEGIN TRANSACTION")
        try:
            yield
        except BaseException:
            self.con.execute("ROLLBACK")
            raise
        self.con.execute("COMMIT")

    def meta(self) -> dict[str, str]:
        return dict(self.con.execute("SELECT key, value FROM meta").fetchall())

    def set_meta_rows(self, values: dict[str, str]) -> None:
        """Set `meta` keys (inside a transaction)."""
        rows = pa.table({"key": list(values), "value": [str(v) for v in values.values()]})
        self.insert_rows("meta", rows, replace=True)

    # -- opening -------------------------------------------------------------------------------
    def _is_delta_file(self) -> bool:
        return bool(
            self.value(
                "SELECT count(*) FROM information_schema.tables WHERE table_name = ? "
                "AND table_catalog = current_database()",
                [DELTA_INFO],
            )
        )

    def base_name(self) -> str:
        return self.value(f"SELECT value FROM {DELTA_INFO} WHERE key = 'base'")

    def _attach_base(self) -> None:
        path = self.path.parent / self.base_name()
        if not path.is_file():
            raise StoreFormatError(
                f"catalog {self.path.name} is a delta over {path.name}, which is missing; run "
                f"`ragkv verify --repair --store {self.path.parent}`"
            )
        self._attach_once(path)
        self.delta = True
        self._define_views(self.con)

    def _define_views(self, con: duckdb.DuckDBPyConnection) -> None:
        """Define on `con` a delta's temporary view of each table (temporary views are per
        connection)."""
        for table in TABLE_KEYS:
            con.execute(f"CREATE OR REPLACE TEMP VIEW {table} AS {self.view_sql(table)}")

    def view_sql(self, table: str) -> str:
        """What a delta's view of `table` reads: the base's rows less `del_t`, plus `add_t`."""
        # A reader's delta never changes: a table nothing deleted from needs no anti-join.
        deleted = not self.read_only or self.value(f"SELECT count(*) FROM del_{table}")
        live = (
            f"SELECT * FROM base.{table} b WHERE NOT EXISTS (SELECT 1 FROM del_{table} d WHERE {_on(table, 'd', 'b')})"
            if deleted
            else f"SELECT * FROM base.{table}"
        )
        return f"{live} UNION ALL SELECT * FROM add_{table}"

    def _attach_once(self, path: Path) -> None:
        """Attach the base as `base`, unless this database instance has it already (DuckDB
        shares one instance between connections to the same file in a process).

        Not `ATTACH IF NOT EXISTS`: DuckDB (1.5 and 2.0 measured) can spin forever in it
        when a process attaches one file read-only from several instances, opening a new one
        before it closes the old (a reader switching generations does exactly that: the
        reproduction hung within a few hundred switches; a plain ATTACH ran thousands)."""
        if not self._base_attached():
            try:
                self.con.execute(f"ATTACH '{path}' AS base (READ_ONLY)")
            except duckdb.BinderException:  # another connection to this instance attached it just now
                if not self._base_attached():
                    raise

    def _base_attached(self) -> bool:
        return bool(self.value("SELECT count(*) FROM duckdb_databases() WHERE database_name = 'base' AND NOT internal"))

    @staticmethod
    def create_delta(con, base_name: str) -> None:
        """Make the file `con` has open (empty, with `base` attached) an empty delta over it."""
        con.execute(f"CREATE TABLE {DELTA_INFO} (key VARCHAR PRIMARY KEY, value VARCHAR NOT NULL)")
        con.execute(f"INSERT INTO {DELTA_INFO} VALUES ('base', ?)", [base_name])
        for table, keys in TABLE_KEYS.items():
            con.execute(f"CREATE TABLE add_{table} AS SELECT * FROM base.{table} LIMIT 0")
            con.execute(f"CREATE TABLE del_{table} AS SELECT {', '.join(keys)} FROM base.{table} LIMIT 0")
        con.execute(f"CREATE TABLE {GONE_VECTORS} (chunk_id BIGINT PRIMARY KEY)")

    # -- writing -------------------------------------------------------------------------------
    def insert_rows(
        self,
        table: str,
        rows: pa.Table | None = None,
        select: str = "SELECT * FROM rows",
        params=(),
        replace: bool = False,
    ) -> None:
        """Insert the rows `select` gives (over `rows`, registered as `rows`), matched to the
        table's columns by name; `replace`: rows whose key is present replace them."""
        # `rows` is found by DuckDB's replacement scan (a Python variable of the calling frame).
        if not self.delta:
            self.con.execute(f"INSERT {'OR REPLACE ' if replace else ''}INTO {table} BY NAME {select}", list(params))
            return
        self.con.execute(f"CREATE OR REPLACE TEMP TABLE _new AS {select}", list(params))
        if replace:
            self._forget_keys(table, "_new")
        self.con.execute(f"INSERT INTO add_{table} BY NAME SELECT * FROM _new")
        self.con.execute("DROP TABLE _new")

    def delete_rows(self, table: str, where: str, params=(), rows: pa.Table | None = None) -> None:
        """Delete the rows of `table` matching `where` (over its plain column names)."""
        if not self.delta:  # `rows`, if given, is found by DuckDB's replacement scan
            self.con.execute(f"DELETE FROM {table} WHERE {where}", list(params))
            return
        keys = ", ".join(TABLE_KEYS[table])
        self.con.execute(
            f"CREATE OR REPLACE TEMP TABLE _gone AS SELECT {keys} FROM {table} WHERE {where}", list(params)
        )
        self._forget_keys(table, "_gone")
        self.con.execute("DROP TABLE _gone")

    def _forget_keys(self, table: str, keys_table: str) -> None:
        """Remove the rows whose keys `keys_table` holds: tombstones for base rows, deletion
        for the delta's own."""
        keys = ", ".join(f"k.{k}" for k in TABLE_KEYS[table])
        self.con.execute(
            f"INSERT INTO del_{table} SELECT DISTINCT {keys} FROM {keys_table} k WHERE EXISTS (SELECT 1 FROM "
            f"base.{table} b WHERE {_on(table, 'b', 'k')}) AND NOT EXISTS (SELECT 1 FROM del_{table} d WHERE "
            f"{_on(table, 'd', 'k')})"
        )
        self.con.execute(
            f"DELETE FROM add_{table} a WHERE EXISTS (SELECT 1 FROM {keys_table} k WHERE {_on(table, 'a', 'k')})"
        )

    # -- sizes and compaction ------------------------------------------------------------------
    def delta_rows(self) -> int:
        """Rows the delta holds (added, deleted and tombstoned vectors): what a writer copies."""
        if not self.delta:
            return 0
        total = sum(
            self.value(f"SELECT (SELECT count(*) FROM add_{t}) + (SELECT count(*) FROM del_{t})") for t in TABLE_KEYS
        )
        return total + (self.value(f"SELECT count(*) FROM {GONE_VECTORS}") if self.delta else 0)

    def base_rows(self) -> int:
        source = "base." if self.delta else ""
        return sum(self.value(f"SELECT count(*) FROM {source}{t}") for t in TABLE_KEYS)

    def compact_into(self, path: Path) -> None:
        """Write every table as this catalog reads it into a new plain catalog at `path` (the
        current schema: rows of an older one get its new columns' defaults), each table sorted
        by its key in row groups of BASE_ROW_GROUP rows, so a point lookup reads little."""
        type(self)(path, read_only=False).close()  # type: ignore[call-arg] # Catalog's constructor: empty, migrated
        self.con.execute(f"ATTACH '{path}' AS fresh (ROW_GROUP_SIZE {BASE_ROW_GROUP})")
        try:
            for table in TABLE_KEYS:
                if table == "meta":  # the new file's own migrations and format stand
                    self.con.execute(
                        "INSERT OR REPLACE INTO fresh.meta SELECT key, value FROM meta "
                        "WHERE key NOT IN ('migrations', 'format_version')"
                    )
                else:
                    order = ", ".join(TABLE_KEYS[table])
                    self.con.execute(f"INSERT INTO fresh.{table} BY NAME SELECT * FROM {table} ORDER BY {order}")
            self.con.execute("CHECKPOINT fresh")
        finally:
            self.con.execute("DETACH fresh")
