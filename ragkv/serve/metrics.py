"""`ragkv serve`'s Prometheus metrics (GET /metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ragkv.store.kv.writeback import FoldLoop


class Metrics:
    """The service's Prometheus metrics. Over several stores, the RAM tier's and the pending
    area's figures are their sums, and the generation is the first store's. No label names a
    document, a tenant or a key."""

    def __init__(self, engines: list, stepped, folding: FoldLoop | None = None):
        """`engines`: every store's (ragkv.serve.stores.Stores.engines); `stepped`: the engine
        that steps them (its queue and batch are gauged)."""
        engine = engines[0]
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("ragkv_requests", "HTTP requests", ["endpoint", "status"], registry=r)
        self.ttft = Histogram(
            "ragkv_ttft_seconds",
            "Time to first token",
            registry=r,
            buckets=(0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 12.8),
        )
        self.reused = Counter("ragkv_tokens_reused", "Prompt tokens whose KV came from the store", registry=r)
        self.computed = Counter("ragkv_tokens_computed", "Prompt tokens prefilled", registry=r)
        self.generated = Counter("ragkv_tokens_generated", "Answer tokens", registry=r)
        self.misses = Counter(
            "ragkv_chunks_computed", "Chunks whose KV was computed on the answer path (the store had none)", registry=r
        )
        self.cancelled = Counter(
            "ragkv_requests_cancelled",
            "Requests whose client went away before the answer ended (their rows leave the batch at the next step)",
            registry=r,
        )

        def total(figure):
            return lambda: sum(figure(e) for e in engines)

        Gauge("ragkv_ram_tier_bytes", "Bytes of chunk KV in the RAM tier", registry=r).set_function(
            total(lambda e: e.ram.bytes)
        )
        Gauge("ragkv_ram_tier_entries", "Chunk KV entries in the RAM tier (which: /v1/cache)", registry=r).set_function(
            total(lambda e: len(e.ram))
        )
        Gauge("ragkv_ram_tier_hits", "RAM tier hits", registry=r).set_function(total(lambda e: e.ram.hits))
        Gauge("ragkv_ram_tier_misses", "RAM tier misses", registry=r).set_function(total(lambda e: e.ram.misses))
        Gauge("ragkv_store_generation", "Store generation being served", registry=r).set_function(
            lambda: engine.snapshot.generation
        )
        Gauge("ragkv_batch_running", "Requests in the running batch (decoding or prefilling)", registry=r).set_function(
            lambda: stepped.num_running
        )
        Gauge("ragkv_requests_waiting", "Requests waiting to join the batch", registry=r).set_function(
            lambda: stepped.num_waiting
        )
        Gauge(
            "ragkv_tokens_per_second", "Answer tokens generated per second over the last 10 s", registry=r
        ).set_function(stepped.tokens_per_s)
        Gauge(
            "ragkv_chunks_written_back", "Entries of KV computed on a miss and stored by the write-back", registry=r
        ).set_function(total(lambda e: e.loader.written_back()))
        Gauge(
            "ragkv_pending_dropped", "Computed KV entries dropped to stay within --pending-bytes (S3)", registry=r
        ).set_function(total(lambda e: e.loader.pending_dropped()))
        Gauge(
            "ragkv_pending_uploaded_bytes", "Bytes left pending for the writer's fold (S3): KV and uses", registry=r
        ).set_function(total(lambda e: e.loader.pending_uploaded()))
        if folding is not None:
            Gauge("ragkv_folds", "Folds this writer replica published", registry=r).set_function(lambda: folding.folds)

    def record(self, stats) -> None:
        self.ttft.observe(stats.ttft_s)
        self.reused.inc(stats.reused_tokens)
        self.computed.inc(stats.computed_tokens + stats.recomputed_tokens)
        self.generated.inc(stats.generated_tokens)
        self.misses.inc(sum(source == "computed" for source in stats.kv_sources.values()))
