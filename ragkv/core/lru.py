"""A least-recently-used map of tensors (or KV entries) bounded by their total bytes, with hit/miss counters."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

V = TypeVar("V")


def nbytes(value) -> int:
    """Bytes held by a tensor or anything that says its own (`nbytes`: a KV entry), or by the
    values in a tuple/list."""
    if isinstance(value, (tuple, list)):
        return sum(nbytes(v) for v in value)
    return int(getattr(value, "nbytes", 0))


class ByteLRU(Generic[V]):
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._items: OrderedDict[Hashable, tuple[V, int]] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0

    def get(self, key: Hashable) -> V | None:
        """The value (now most recently used), or None; counts a hit or a miss."""
        found = self._items.get(key)
        if found is None:
            self.misses += 1
            return None
        self._items.move_to_end(key)
        self.hits += 1
        return found[0]

    def put(self, key: Hashable, value: V, size: int | None = None) -> None:
        """Remember `value` (its bytes: `size`, else counted from its tensors); evicts least
        recently used items beyond `max_bytes`. A value larger than the whole budget is not kept."""
        size = nbytes(value) if size is None else size
        if size > self.max_bytes:
            return
        if key in self._items:
            self.bytes -= self._items.pop(key)[1]
        self._items[key] = (value, size)
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, (_, evicted) = self._items.popitem(last=False)
            self.bytes -= evicted

    def pop(self, key: Hashable) -> V | None:
        """Take `key` out (it is the caller's now), or None."""
        found = self._items.pop(key, None)
        if found is None:
            return None
        self.bytes -= found[1]
        return found[0]

    def keys(self) -> list[Hashable]:
        """The keys held, least recently used first."""
        return list(self._items)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def stats(self) -> dict:
        return {
            "entries": len(self),
            "bytes": self.bytes,
            "max_bytes": self.max_bytes,
            "hits": self.hits,
            "misses": self.misses,
        }
