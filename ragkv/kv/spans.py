"""Spans and the key chain: the one home of how a sequence of chunks is keyed.

A span is a run of a document's chunks whose KV was computed as one sequence after the
profile's prefix (`ingest --span-tokens`). Its first chunk is a segment of its own ids, keyed
as a chunk alone; every later chunk is the segment separator + its ids, keyed by chaining
from the key before it (`KVKey.then`), so an edit anywhere earlier changes every later key.
A chunk stored on its own is a span of one. The in-process prefix cache keys the segments
that follow a stored chunk the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from ragkv.core.keys import KVKey, Profile

T = TypeVar("T")


def segment(position: int, chunk_ids: Sequence[int], separator: Sequence[int]) -> tuple[int, ...]:
    """The ids a span's chunk at `position` adds: the first chunk bare, later ones after the separator."""
    return tuple(chunk_ids) if position == 0 else (*separator, *chunk_ids)


def segments(chunks: Iterable[Sequence[int]], separator: Sequence[int]) -> list[tuple[int, ...]]:
    """The segments a span's KV is computed from, in order (see `segment`)."""
    return [segment(i, ids, separator) for i, ids in enumerate(chunks)]


def next_key(profile: Profile, key: KVKey | None, segment_ids: Sequence[int]) -> KVKey:
    """The key of `segment_ids` after the entry `key` names; with no key, the segment opens a span."""
    return KVKey.for_chunk(profile, segment_ids) if key is None else key.then(segment_ids)


def continuations(
    profile: Profile, key: KVKey | None, ids: Sequence[int], pos: int, lengths: Iterable[int]
) -> dict[str, tuple[KVKey, list[int]]]:
    """Every segment of one of `lengths` that could continue `ids` at `pos` after the entry
    `key` names (none: opening a span), by its key's string: the key and the segment's ids."""
    found = {}
    for n in lengths:
        if pos + n <= len(ids):
            segment_ids = list(ids[pos : pos + n])
            continued = next_key(profile, key, segment_ids)
            found[continued.to_string()] = (continued, segment_ids)
    return found


def chain(root: KVKey, segment_list: Iterable[Sequence[int]]) -> list[KVKey]:
    """The keys of segments that follow, one after another, the entry `root` names."""
    keys, key = [], root
    for ids in segment_list:
        key = key.then(ids)
        keys.append(key)
    return keys


def span_keys(profile: Profile, chunks: Sequence[Sequence[int]], separator: Sequence[int]) -> list[KVKey]:
    """The key of each chunk of a span whose chunks' ids are `chunks`, in order."""
    if not chunks:
        return []
    first = KVKey.for_chunk(profile, chunks[0])
    return [first, *chain(first, segments(chunks, separator)[1:])]


def runs(items: Sequence[T], continues: Callable[[T, T], bool]) -> list[list[T]]:
    """`items` cut into runs, in order: an item joins the run before it when
    `continues(previous, item)`, else it opens a new one."""
    grouped: list[list[T]] = []
    for item in items:
        if grouped and continues(grouped[-1][-1], item):
            grouped[-1].append(item)
        else:
            grouped.append([item])
    return grouped
