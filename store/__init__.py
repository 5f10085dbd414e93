"""Persistence only: KV shards (safetensors), the DuckDB catalog, the FAISS index, and the
generations that publish catalog and index together. Never imports transformers."""

from store.catalog import Catalog, ChunkRow, ContextRow, DocumentRow, EntryRow
from store.gc import GcReport, collect_garbage
from store.shards import SealedEntry, ShardReader, ShardWriter, checksum
from store.store import StoreSnapshot, StoreWriter, is_store, open_snapshot
from store.vectors import Hit, VectorIndex
from store.verify import Problem, VerifyReport, verify

__all__ = [
    "Catalog",
    "ChunkRow",
    "ContextRow",
    "DocumentRow",
    "EntryRow",
    "Hit",
    "SealedEntry",
    "ShardReader",
    "ShardWriter",
    "StoreSnapshot",
    "StoreWriter",
    "VectorIndex",
    "checksum",
    "is_store",
    "open_snapshot",
    "GcReport",
    "collect_garbage",
    "Problem",
    "VerifyReport",
    "verify",
]
