"""An in-process cache of prompt-segment KV, so a long-running process never recomputes the
same combination of chunks (or the same conversation prefix) twice.

A segment is a run of token ids (a separator plus a chunk, a conversation turn). Its key is a
chain `h_i = H(h_{i-1} || token bytes of segment i)` from a root that names everything before
the first segment (the profile and the stored chunk), like vLLM's block hashes with
variable-size blocks. A hit is accepted only after the stored token ids compare equal.
Bounded in bytes; least recently used segments go first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ragkv.keys import digest, token_bytes
from ragkv.lru import ByteLRU


@dataclass(frozen=True)
class PrefixMatch:
    kvs: list[torch.Tensor]  # canonical (L, 2, H, T_i, D) of the matched leading segments

    @property
    def num_segments(self) -> int:
        return len(self.kvs)

    @property
    def num_tokens(self) -> int:
        return sum(kv.shape[3] for kv in self.kvs)


def chain(root: str, segments: Sequence[Sequence[int]]) -> list[str]:
    """The key of each segment: a hash of the root and every segment up to and including it."""
    keys, previous = [], root
    for ids in segments:
        previous = digest(previous, token_bytes(ids))
        keys.append(previous)
    return keys


class PrefixCache:
    def __init__(self, max_bytes: int):
        self._lru: ByteLRU[tuple[tuple[int, ...], torch.Tensor]] = ByteLRU(max_bytes)
        self.hits = 0  # segments found
        self.misses = 0  # segments looked for and not found

    @property
    def max_bytes(self) -> int:
        return self._lru.max_bytes

    @property
    def bytes(self) -> int:
        return self._lru.bytes

    def match(self, root: str, segments: Sequence[Sequence[int]]) -> PrefixMatch:
        """The KV of the longest run of leading `segments` this cache holds (after `root`)."""
        kvs = []
        for key, ids in zip(chain(root, segments), segments):
            found = self._lru.get(key)
            if found is None or found[0] != tuple(ids):
                break
            kvs.append(found[1])
        self.hits += len(kvs)
        self.misses += len(segments) - len(kvs)
        return PrefixMatch(kvs)

    def insert(self, root: str, segments: Sequence[Sequence[int]], kvs: Sequence[torch.Tensor]) -> None:
        """Remember `kvs[i]`, the KV of `segments[i]` computed after `root` and the segments
        before it. May evict least recently used entries."""
        for key, ids, kv in zip(chain(root, segments), segments, kvs):
            if key not in self._lru:
                self._lru.put(key, (tuple(ids), kv))

    def __len__(self) -> int:
        return len(self._lru)
