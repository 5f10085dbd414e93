"""What a store holds and what it costs on disk."""

from __future__ import annotations

from store.shards import shard_files
from store.store import StoreSnapshot


def store_stats(snapshot: StoreSnapshot) -> dict:
    """Counts, tokens and bytes per model profile, and shard space: live (referenced by this
    generation's entries) vs dead (anything else in shard files: gc reclaims it)."""
    catalog = snapshot.catalog
    files = snapshot.remote.shards() if snapshot.remote else shard_files(snapshot.root / "shards")
    referenced = catalog.shards()
    live_bytes = catalog.kv_bytes()
    disk_bytes = sum(files.values())
    return {
        "store": snapshot.location,
        "generation": snapshot.generation,
        **catalog.counts(),
        "vectors": len(snapshot.vectors),
        "embedder": catalog.meta().get("embedder"),
        "profiles": [
            {"model": p["model_name"], "dtype": p["dtype"], "kv_quant": p["kv_quant"], "profile_id": p["profile_id"],
             "entries": p["entries"], "chunks": p["chunks"], "tokens": p["tokens"], "kv_bytes": p["kv_bytes"]}
            for p in catalog.profile_totals()
        ],
        "shards": len(files),
        "shards_unreferenced": len(set(files) - referenced),
        "shard_bytes": disk_bytes,
        "live_bytes": live_bytes,
        "dead_bytes": max(disk_bytes - live_bytes, 0),
    }
