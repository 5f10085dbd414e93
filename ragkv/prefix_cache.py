"""An in-process cache of prompt-segment KV, so a long-running process never recomputes the
same combination of chunks (or the same conversation prefix) twice.

A segment is a run of token ids (a separator plus a chunk, a conversation turn). Its key is a
chain `h_i = H(h_{i-1} || token bytes of segment i)` from a root that names everything before
the first segment (the profile and the stored chunk), like vLLM's block hashes with
variable-size blocks. A hit is accepted only after the stored token ids compare equal.
Bounded in bytes; least recently used segments go first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import torch

from ragkv.keys import digest, token_bytes


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
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, tuple[tuple[int, ...], torch.Tensor]] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0

    def match(self, root: str, segments: Sequence[Sequence[int]]) -> PrefixMatch:
        """The KV of the longest run of leading `segments` this cache holds (after `root`)."""
        kvs = []
        for key, ids in zip(chain(root, segments), segments):
            found = self._entries.get(key)
            if found is None or found[0] != tuple(ids):
                break
            self._entries.move_to_end(key)
            kvs.append(found[1])
        self.hits += len(kvs)
        self.misses += len(segments) - len(kvs)
        return PrefixMatch(kvs)

    def insert(self, root: str, segments: Sequence[Sequence[int]], kvs: Sequence[torch.Tensor]) -> None:
        """Remember `kvs[i]`, the KV of `segments[i]` computed after `root` and the segments
        before it. May evict least recently used entries."""
        for key, ids, kv in zip(chain(root, segments), segments, kvs):
            size = kv.numel() * kv.element_size()
            if key in self._entries or size > self.max_bytes:
                continue
            self._entries[key] = (tuple(ids), kv)
            self.bytes += size
        while self.bytes > self.max_bytes:
            _, (_, evicted) = self._entries.popitem(last=False)
            self.bytes -= evicted.numel() * evicted.element_size()

    def __len__(self) -> int:
        return len(self._entries)
