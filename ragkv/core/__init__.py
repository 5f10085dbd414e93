"""The core: errors, on-disk formats, cache keys, settings, filters, text checks, the CPU's
abilities and a bounded LRU. It imports nothing of ragkv above it, and it is all that ragkv.store
may import, so the store never loads a model library."""
