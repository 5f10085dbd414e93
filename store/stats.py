"""What a store holds and what it costs on disk."""

from __future__ import annotations

import json
import math
import time
from typing import Any

from ragkv.store.kv.pending import HITS_SUFFIX, MANIFEST_SUFFIX, PendingArea
from ragkv.store.kv.pending_hits import read_hits
from ragkv.store.kv.popularity import decay, read_pending, tally
from ragkv.store.snapshot import StoreSnapshot

NUM_LISTED = 5  # hottest and coldest documents shown


def store_stats(snapshot: StoreSnapshot) -> dict:
    """Counts, tokens and bytes per model profile, and shard space: live (referenced by this
    generation's entries) vs dead (anything else in shard files: gc reclaims it)."""
    catalog = snapshot.catalog
    files = snapshot.shard_sizes()
    referenced = catalog.reports.shards()
    live_bytes = catalog.reports.kv_bytes()
    disk_bytes = sum(files.values())
    return {
        "store": snapshot.location,
        "generation": snapshot.generation,
        "written_by": snapshot.written_by,
        **catalog.reports.counts(),
        "vectors": len(snapshot.vectors),
        "index": snapshot.vectors.describe(),
        "catalog": {
            "base": catalog.base_name() if catalog.delta else None,
            "base_rows": catalog.base_rows(),
            "delta_rows": catalog.delta_rows(),
        },
        "embedder": catalog.meta().get("embedder"),
        # {"query", "document"}: the text put before each side when embedding; None: the store was
        # written before prompts were recorded, and both sides are embedded plainly, as it was built
        "embedder_prompts": json.loads(prompts) if (prompts := catalog.meta().get("embedder_prompts")) else None,
        "profiles": [
            {
                "model": p.model_name,
                "dtype": p.dtype,
                "kv_quant": p.kv_quant,
                "profile_id": p.profile_id,
                "entries": p.entries,
                "chunks": p.chunks,
                "tokens": p.tokens,
                "kv_bytes": p.kv_bytes,
                **layout_summary(p.kv_layout),
            }
            for p in catalog.reports.profile_totals()
        ],
        "shards": len(files),
        "shards_unreferenced": len(set(files) - referenced),
        "shard_bytes": disk_bytes,
        "live_bytes": live_bytes,
        "dead_bytes": max(disk_bytes - live_bytes, 0),
        "kv_budget": catalog.usage.kv_budget(),
        **pending_totals(snapshot),
        **popularity(snapshot),
    }


_ITEMSIZE = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}


def layout_summary(kv_layout: str | None) -> dict:
    """What a profile's cache holds per layer, from its recorded layout (ragkv.kv.layout's JSON):
    layers holding KV, layers keeping a recurrent state, and the bytes of the state every entry
    ends with (counted in kv_bytes, by the budget and by gc like the KV)."""
    if not kv_layout:
        return {"kv_layers": None, "state_layers": 0, "state_bytes_per_entry": 0}
    fields = json.loads(kv_layout)
    if "groups" not in fields:  # one group over every layer (the form earlier ragkv wrote too)
        return {"kv_layers": len(fields["windows"]), "state_layers": 0, "state_bytes_per_entry": 0}
    states = fields["states"]
    return {
        "kv_layers": sum(len(group["layers"]) for group in fields["groups"]),
        "state_layers": len({state["layer"] for state in states}),
        "state_bytes_per_entry": sum(math.prod(s["shape"]) * _ITEMSIZE.get(s["dtype"], 4) for s in states),
    }


def pending_totals(snapshot: StoreSnapshot) -> dict:
    """What readers left for the writer to fold (ragkv.store.kv.pending): whole objects and their bytes."""
    names = PendingArea(snapshot.location).names()
    manifests = {n.removesuffix(MANIFEST_SUFFIX) for n in names if n.endswith(MANIFEST_SUFFIX)}
    whole = {n: size for n, size in names.items() if n.rsplit(".", 1)[0] in manifests}
    hits = [n for n in names if n.endswith(HITS_SUFFIX)]
    return {"pending_objects": len(manifests), "pending_bytes": sum(whole.values()), "pending_hit_objects": len(hits)}


def popularity(snapshot: StoreSnapshot) -> dict:
    """Hit rate (uses whose chunk KV was ready, of those that needed it) and the hottest and
    coldest documents by ageing score, counting uses logged since the last fold too."""
    catalog = snapshot.catalog
    half_life = catalog.usage.half_life_s()
    rows = catalog.usage.chunk_hits()
    folded = catalog.usage.folded_offsets()
    pending = read_pending(snapshot.root, folded).uses  # a bucket's mirror holds none: []
    pending += read_hits(PendingArea(snapshot.location), folded).uses
    tally(rows, pending, half_life)
    now = time.time()
    hits = sum(r.hits for r in rows.values())
    misses = sum(r.misses for r in rows.values())
    docs: dict[str, dict[str, Any]] = {d: {"doc_id": d, "uses": 0, "score": 0.0} for d in catalog.documents.all()}
    for (doc_id, _), row in rows.items():
        if doc_id in docs:
            docs[doc_id]["uses"] += row.uses
            docs[doc_id]["score"] += decay(row.score, row.last_use, now, half_life)
    ranked = sorted(docs.values(), key=lambda d: (-d["score"], d["doc_id"]))
    for d in ranked:
        d["score"] = round(d["score"], 3)
    return {
        "uses": sum(r.uses for r in rows.values()),
        "kv_hits": hits,
        "kv_misses": misses,
        "hit_rate": round(hits / (hits + misses), 4) if hits + misses else None,
        "hottest": ranked[:NUM_LISTED],
        "coldest": ranked[::-1][:NUM_LISTED],
    }
