"""An in-process cache of prompt-segment KV, so a long-running process never recomputes the
same combination of chunks (or the same conversation prefix) twice.

A segment is a run of token ids (a separator plus a chunk). Its key chains from the key of the
stored entry before it (`ragkv.kv.spans.chain`: `h_i = H(h_{i-1} || token bytes of segment i)`),
like vLLM's block hashes with variable-size blocks, and is the key the same segment has in a
stored span. A hit is accepted only after the stored token ids compare equal.
Bounded in bytes; least recently used segments go first.

A request with a tenant (ragkv.core.scope) chains from a root salted with it (`salted`), so one
tenant never hits segments another computed: a hit answers measurably faster, which would tell
a tenant what another asked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ragkv.core.keys import KVKey, digest
from ragkv.core.lru import ByteLRU
from ragkv.kv.entry import Entry
from ragkv.kv.spans import chain


@dataclass(frozen=True)
class PrefixMatch:
    kvs: list[Entry]  # the matched leading segments' entries (with the state at each one's end)

    @property
    def num_segments(self) -> int:
        return len(self.kvs)

    @property
    def num_tokens(self) -> int:
        return sum(kv.num_tokens for kv in self.kvs)


class PrefixCache:
    def __init__(self, max_bytes: int):
        self._lru: ByteLRU[tuple[tuple[int, ...], Entry]] = ByteLRU(max_bytes)
        self.hits = 0  # segments found
        self.misses = 0  # segments looked for and not found

    @property
    def max_bytes(self) -> int:
        return self._lru.max_bytes

    @property
    def bytes(self) -> int:
        return self._lru.bytes

    def match(self, root: KVKey, segments: Sequence[Sequence[int]], count: bool = True) -> PrefixMatch:
        """The KV of the longest run of leading `segments` this cache holds (after `root`);
        counted in `hits` and `misses` unless `count` is False (a second look)."""
        kvs = []
        for key, ids in zip(_names(root, segments), segments, strict=False):
            found = self._lru.get(key)
            if found is None or found[0] != tuple(ids):
                break
            kvs.append(found[1])
        if count:
            self.hits += len(kvs)
            self.misses += len(segments) - len(kvs)
        return PrefixMatch(kvs)

    def insert(self, root: KVKey, segments: Sequence[Sequence[int]], kvs: Sequence[Entry | None]) -> None:
        """Remember `kvs[i]`, the KV of `segments[i]` computed after `root` and the segments
        before it (None: not this one). May evict least recently used entries."""
        for key, ids, kv in zip(_names(root, segments), segments, kvs, strict=False):
            if kv is not None and key not in self._lru:
                self._lru.put(key, (tuple(ids), kv))

    def __len__(self) -> int:
        return len(self._lru)


def _names(root: KVKey, segments: Sequence[Sequence[int]]) -> list[str]:
    return [key.to_string() for key in chain(root, segments)]


def salted(root: KVKey, salt: str) -> KVKey:
    """The root the segments of a request whose caches are keyed by `salt` (its tenant) chain
    from: `root` itself for "" (no tenant)."""
    if not salt:
        return root
    return KVKey(root.profile_id, digest(root.entry_digest, "tenant", salt))
