"""Persistence only: KV shards (safetensors), the DuckDB catalog, the FAISS index, and the
generations that publish catalog and index together. Never imports transformers."""

from ragkv.store.catalog import Catalog, ChunkRow, ContextRow, DocumentRow, EntryRow
from ragkv.store.gc import GcReport, collect_garbage
from ragkv.store.index.vectors import Hit, VectorIndex
from ragkv.store.kv.shards import SealedEntry, ShardReader, ShardWriter, checksum
from ragkv.store.snapshot import StoreSnapshot, is_store, open_snapshot
from ragkv.store.verify import Problem, VerifyReport, verify
from ragkv.store.writer import StoreWriter

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
