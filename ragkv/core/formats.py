"""Every on-disk format ragkv writes, its version, and what each ragkv does with another's.

    store (a generation's manifest)  STORE_FORMAT    3   (1: 0.1.x before segments: one catalog + one index file;
                                                         2: segments flat or IVF-flat, still written when
                                                         a store has no IVF-PQ segment)
    catalog schema                   named migrations in store.catalog.schema.MIGRATIONS
    KV layout                        ragkv.kv.layout.KVLayout, in each profile row (NULL: plain) and, when
                                     not plain, in the profile id; shard headers name it (`layout`)
    KV shard (safetensors header)    SHARD_FORMAT    "1"
    cache key strings                KEY_FORMAT      1   (`kv1:PROFILE:DIGEST`)
    lexical file (safetensors)       ragkv.store.index.lexical.ANALYSER, recorded in the file and the manifest

The policy:
- **Read as it is:** every older store format (1 and 2) and every older catalog schema. A
  reader never writes, so an older store opened by `ragkv ask` or `serve` stays as it was.
- **Migrated once, by its first writer** (`ingest`, `reindex`, `gc`, `verify --repair`): a
  format-1 store becomes format 2 by hard links (no data copied; one logged warning), and a
  catalog's missing migrations are applied in order (a delta over an older base: by compacting).
- **Refused, in one line naming both versions:** a store whose manifest is of a format this
  ragkv does not know (a newer ragkv's), and a catalog with migrations this ragkv lacks. Nothing
  is read or written then; upgrade ragkv.
- **Added to, not bumped:** a segment's lexical file is an optional part of a format-2 manifest
  (`terms`, `analyser`): an older ragkv ignores it; a newer one reads a store without it (or
  with another analyser's) as it is, answers lexical searches with dense retrieval saying so,
  and its next writer builds it from the chunks' texts.
- **Bumped only where used:** a manifest is format 3 when it lists an IVF-PQ segment (a large
  store's index since 0.2: codes in memory, float32 vectors on disk beside them, read row by row
  for the re-score), which a ragkv reading format 2 would search without the re-score and could not
  compact: it refuses the store instead. A store without one is still written as format 2. An
  IVF-flat segment of an earlier ragkv is read as it is, and rewritten as IVF-PQ by the next
  compaction.
- **Never stale:** a change of the key derivation bumps KEY_FORMAT (it is hashed into every
  profile id), so no entry computed under the old rule is ever matched.
A manifest records the version of the ragkv that wrote it (`ragkv stats` shows it).
"""

__version__ = "0.2.0"  # ragkv's own (the package metadata reads it from here)

STORE_FORMAT = 3
SHARD_FORMAT = "1"
KEY_FORMAT = 1
