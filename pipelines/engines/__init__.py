"""Ingest on other engines: Ray Data (workers and driver) and vLLM (`--engine vllm`). The local
engine is pipelines.ingest itself."""
