"""The offline path, one stage per module: read → chunk → plan (what is missing) → compute KV →
write; `pipelines.ingest` runs them, `pipelines.nightly` is the re-index job."""
