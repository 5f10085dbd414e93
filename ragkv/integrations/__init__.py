"""Serving engines that read a ragkv store: `vllm` (a KV connector). `store_match` is the
engine-neutral part: which leading prompt tokens the store holds, and their KV."""
