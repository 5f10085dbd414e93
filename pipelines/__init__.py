"""The offline path, one stage per module: read → chunk → plan (what is missing) → compute KV →
write; `ragkv.pipelines.ingest` runs them, `ragkv.pipelines.nightly` is the re-index job."""
