"""What a store holds, as one caller may see it: the store panel of `ragkv serve`'s dashboard
(/ui). A caller with filters sees only the documents they admit, and none of the store's own
totals (its bytes, generation or popularity would tell of the others)."""

from __future__ import annotations

import json
import time

from ragkv.core.config import SearchSettings
from ragkv.core.scope import Scope
from ragkv.engine.runtime import Runtime
from ragkv.store.stats import layout_summary, store_stats

MAX_LISTED = 500  # documents listed with their chunks; the counts cover them all
STORE_FIGURES = ("generation", "shard_bytes", "live_bytes", "kv_budget", "index", "uses", "hottest", "hit_rate")
FIGURES_FRESH_S = 10.0  # the store's own figures (~30 ms of catalog reads) are kept this long per generation
_figures: dict[tuple[str, int], tuple[float, dict]] = {}  # (store, generation) -> (when, figures)


def overview(runtime: Runtime, scope: Scope | None) -> dict:
    """The documents `scope` admits (inside the engine's own), each with its chunks: index, id,
    whether its KV is stored under the served model, and its text's opening; the model, its
    cache layout and the embedder; and, for a caller without filters, the store's own figures
    under "store". Run it where the engine's steps run (it reads the catalog)."""
    snapshot, profile = runtime.snapshot, runtime.active.profile
    catalog = snapshot.catalog
    settings = runtime.scoped(SearchSettings(scope=scope))
    chunk_ids = runtime.retriever.visible(settings, sorted(catalog.documents.chunk_ids()))
    documents: dict[str, dict] = {}
    stored = 0
    listing = catalog.reports.chunk_listing(profile.profile_id, chunk_ids)
    for doc_id, source, index, chunk_id, has_kv, opening in listing:
        document = documents.setdefault(doc_id, {"doc_id": doc_id, "source": source, "chunks": []})
        document["chunks"].append({"index": index, "chunk_id": chunk_id, "stored": bool(has_kv), "text": opening})
        stored += bool(has_kv)
    meta = catalog.meta()
    row = catalog.entries.profile(profile.profile_id)
    filtered = settings.scope is not None and bool(settings.scope.filters)
    found = {
        "filtered": filtered,
        "documents": len(documents),
        "chunks": len(chunk_ids),
        "chunks_stored": stored,
        "listed": list(documents.values())[:MAX_LISTED],
        "model": {
            "name": runtime.lm.facts.name,
            "dtype": profile.dtype,
            "kv_quant": profile.kv_quant,
            **layout_summary(row.kv_layout if row is not None else None),
        },
        "embedder": meta.get("embedder"),
        # what goes before a question and a chunk when embedding them; None: recorded before prompts were
        "embedder_prompts": json.loads(prompts) if (prompts := meta.get("embedder_prompts")) else None,
    }
    if not filtered:
        found["store"] = _store_figures(snapshot)
    return found


def _store_figures(snapshot) -> dict:
    """STORE_FIGURES of `ragkv stats`, read at most every FIGURES_FRESH_S per generation: they
    run on the engine's thread, between its steps, so a dashboard left open costs the answers
    little."""
    key, now = (str(snapshot.location), snapshot.generation), time.monotonic()
    kept = _figures.get(key)
    if kept is None or now - kept[0] > FIGURES_FRESH_S:
        figures = store_stats(snapshot)
        if len(_figures) > 32:  # older generations' figures: nobody shows them
            _figures.clear()
        _figures[key] = kept = (now, {name: figures.get(name) for name in STORE_FIGURES})
    return kept[1]


def chunk_texts(runtime: Runtime, chunk_ids, scope: Scope | None) -> dict[int, str]:
    """The stored text of each of `chunk_ids` `scope` admits (inside the engine's); the others
    are left out as if they did not exist. Run it where the engine's steps run."""
    settings = runtime.scoped(SearchSettings(scope=scope))
    visible = runtime.retriever.visible(settings, list(chunk_ids))
    return runtime.snapshot.catalog.documents.chunk_texts(visible)
