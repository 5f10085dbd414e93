"""KV entries in the store: sealed safetensors shards (local and on S3), the pending area readers
leave computed misses in, the write-back that stores them, the popularity log, and the budget that
chooses which entries a store keeps."""
