"""The model: finding, loading and fingerprinting the LLM (`llm`) and the embedder (`embed`), the
prompt's token layout, the forward that computes KV, prefill and decoding, and the self-test that
refuses a model family ragkv cannot serve exactly. Above ragkv.kv and the store."""
