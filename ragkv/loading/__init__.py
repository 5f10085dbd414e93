"""Stored KV on the online path: read and verified from the store, kept hot in RAM, assembled
into the cache a prompt starts from, misses computed and written back. Above the modes."""
