"""What each part of the catalog (`documents`, `entries`, `usage`, `reports`) stands on: the
catalog's connection for its queries, the catalog's overlay-aware writes for its changes."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import duckdb

    from ragkv.store.catalog.schema import Schema


class Part:
    """One family of the catalog's tables, a part of `catalog` (composed, not mixed in)."""

    def __init__(self, catalog: Schema):  # the Catalog (Schema and Overlay are what parts use of it)
        self.catalog = catalog

    @property
    def con(self) -> duckdb.DuckDBPyConnection:
        return self.catalog.con
