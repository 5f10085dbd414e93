"""`ragkv serve`'s dashboard: GET /ui, a page served from the package (its script and style sit
beside it in ragkv/serve/ui/; no CDN, no request leaves the server), and the JSON it reads. The
page sends the caller's key (entered once, kept in the browser's session storage, never in a
URL) with every call, and every call that reads a store goes through the API's front door,
`Stores.open(model, caller)`: a key with filters sees its own documents and its playground
answers, and none of the server-wide figures (charts, what is hot, tenants), which a 403 says.

    GET  /ui, /ui/app.js, /ui/style.css   the page (no key needed: it holds no data)
    GET  /v1/ui/store?model=              the store as the caller may see it (ragkv.engine.overview)
    GET  /v1/ui/series?since=T            the service's counters over time (sampled in memory) after T, and now
    POST /v1/ui/chunks                    the texts of chunk ids the caller may see (for sources)
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from importlib import resources

from fastapi import Depends, FastAPI
from fastapi.responses import Response

from ragkv.core.config import CONTEXTS, MODES, ORDERS, RETRIEVALS
from ragkv.serve.access import require_unfiltered
from ragkv.serve.api import ChunksRequest, RagkvOptions
from ragkv.serve.api_keys import Caller

PAGE_FILES = {
    "": ("index.html", "text/html"),
    "app.js": ("app.js", "text/javascript"),
    "style.css": ("style.css", "text/css"),
}
# Each point of a chart, and the /metrics sample it is read from (counters are running totals:
# the page charts the change from one point to the next).
FIGURES = {
    "requests": "ragkv_requests_total",
    "reused": "ragkv_tokens_reused_total",
    "computed": "ragkv_tokens_computed_total",
    "generated": "ragkv_tokens_generated_total",
    "misses_computed": "ragkv_chunks_computed_total",
    "written_back": "ragkv_chunks_written_back",
    "ram_hits": "ragkv_ram_tier_hits",
    "ram_misses": "ragkv_ram_tier_misses",
    "ram_bytes": "ragkv_ram_tier_bytes",
    "running": "ragkv_batch_running",
    "waiting": "ragkv_requests_waiting",
    "tokens_per_s": "ragkv_tokens_per_second",
}
TTFT = "ragkv_ttft_seconds_bucket"
# The playground's settings, as the API takes them (ragkv.core.config).
_DEFAULTS = RagkvOptions()  # each setting's default first, as a request without it gets
CHOICES = {
    name: [getattr(_DEFAULTS, name), *(v for v in values if v != getattr(_DEFAULTS, name))]
    for name, values in (
        ("mode", (*MODES, "approximate")),
        ("context", CONTEXTS),
        ("order", ORDERS),
        ("retrieval", RETRIEVALS),
    )
}
EVERY_S = 5.0  # a point every 5 s ...
KEPT = 720  # ... for the last hour


class Sampler:
    """The service's Prometheus counters (`registry`) sampled in memory for the charts: a point
    every EVERY_S seconds on a thread of its own, the last KEPT kept. Nothing is stored on
    disk: a restart starts the charts afresh."""

    def __init__(self, registry):
        self.registry = registry
        self.points: deque[dict] = deque(maxlen=KEPT)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def point(self) -> dict:
        """The counters now: each of FIGURES (summed over labels), the TTFT histogram's
        cumulative buckets, and the time."""
        values = dict.fromkeys(FIGURES.values(), 0.0)
        buckets: dict[str, float] = {}
        for metric in self.registry.collect():
            for s in metric.samples:
                if s.name in values:
                    values[s.name] += s.value
                elif s.name == TTFT:
                    buckets[s.labels["le"]] = s.value
        point: dict = {"t": time.time(), **{figure: values[name] for figure, name in FIGURES.items()}}
        point["ttft_buckets"] = buckets
        return point

    def sample(self) -> None:
        """Keep a point (the thread's, every EVERY_S)."""
        point = self.point()
        with self._lock:
            self.points.append(point)

    def series(self, since: float = 0.0) -> tuple[list[dict], dict]:
        """The kept points taken after `since` (a page asks only for those it lacks), and a
        point taken now, not kept: pages asking often cost a point each, not a longer series."""
        now = self.point()
        with self._lock:
            return [p for p in self.points if p["t"] > since], now

    def start(self) -> Sampler:
        def loop() -> None:
            while not self._stop.wait(EVERY_S):
                self.sample()

        self.sample()
        self._thread = threading.Thread(target=loop, name="ragkv-ui-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def add_ui_routes(app: FastAPI, served, stepped, sampler: Sampler) -> None:
    """The page and its JSON on `app` (see the module docstring): `served` the service's stores,
    access and audit (ragkv.serve.service.Served), `stepped` the engine that steps them."""
    page = resources.files("ragkv.serve") / "ui"

    for suffix, (name, media_type) in PAGE_FILES.items():

        def serve_file(name: str = name, media_type: str = media_type) -> Response:
            return Response((page / name).read_bytes(), media_type=media_type, headers={"Cache-Control": "no-cache"})

        app.add_api_route(f"/ui/{suffix}" if suffix else "/ui", serve_file, methods=["GET"], include_in_schema=False)

    @app.get("/v1/ui/store")
    async def store(model: str | None = None, caller: Caller = Depends(served.access)):
        handle = served.stores.open(model, caller)
        found = await asyncio.wrap_future(handle.overview_soon(stepped))
        return {"name": handle.name, **found, "choices": CHOICES}

    @app.post("/v1/ui/chunks")
    async def chunks(body: ChunksRequest, caller: Caller = Depends(served.access)):
        handle = served.stores.open(body.model, caller)
        texts = await asyncio.wrap_future(handle.chunk_texts_soon(stepped, body.chunk_ids))
        return {"chunks": {str(chunk_id): text for chunk_id, text in texts.items()}}

    @app.get("/v1/ui/series")
    async def series(since: float = 0.0, caller: Caller = Depends(served.access)):
        require_unfiltered(caller, "the charts, what is hot and the tenants count every tenant's requests")
        points, now = sampler.series(since)
        return {"every_s": EVERY_S, "points": points, "now": now, "tenants": served.audit.totals.to_dict()}
