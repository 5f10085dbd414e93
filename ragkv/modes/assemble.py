"""Build the cache a prompt starts from, in one of these modes (how several chunks' KV is used):

- `exact`: the first chunk's KV comes from the store; the other chunks are prefilled live on
  top of it (or taken from the in-process prefix cache, which holds exactly that computation
  from an earlier request). Equals a full prefill. For a model with recurrent layers the other
  chunks are computed as the cache is assembled, one forward each, so the prefix cache keeps
  each one's state at its end (a state cannot be cut out of a later prefill).
- `concat` (approximate, TurboRAG-style): every chunk's stored KV, re-rotated to its place.
- `blend` (approximate, CacheBlend-style): `concat`, then the most-deviating share of the
  context tokens recomputed, the selection narrowing layer by layer.
- `epic` (approximate, EPIC/LegoLink-style): `concat`, then the first share of every passage
  after the first recomputed (its separator and first tokens: where it learned its own
  attention sink). No selection pass.
- `query` (approximate, ProphetKV-style): `concat`, then the share of the context tokens the
  question attends to most recomputed, in one forward with the question's prefill
  (`ragkv.modes.blend.attended_recompute`).
- `ape` (approximate, APE-style): `concat`, recomputing nothing; the question and answer attend
  to the passages with APE's temperature and scaling (`ragkv.modes.ape`).

Every function returns an `Assembly`: a cache holding the KV of the prompt's first
`num_cached` tokens, and what it cost.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ragkv.core.keys import KVKey
from ragkv.kv import cache as kv
from ragkv.kv.entry import Entry
from ragkv.kv.rope import check_supported, shift_positions
from ragkv.model.forward import extend
from ragkv.modes.ape import Scaling, attending
from ragkv.modes.blend import BlendResult, Recompute, attended_recompute, blend, recompute_starts
from ragkv.modes.prefix_cache import PrefixCache


@dataclass
class Assembly:
    cache: Any  # transformers cache holding the prompt's first `num_cached` tokens (batch 1)
    reused_tokens: int = 0  # of those, KV taken from the store or the prefix cache
    computed_tokens: int = 0  # of those, computed as the cache was assembled (exact, recurrent layers)
    recomputed_tokens: int = 0  # context tokens whose approximate KV was recomputed (blend)
    prefix_cache_tokens: int = 0  # of the reused, those that came from the in-process prefix cache
    after_prefill: Callable[[object], None] | None = field(default=None, repr=False)
    # exact: before the prefill starts, append to the cache what the prefix cache holds now of
    # the tokens after it (another request computed them since); returns the tokens appended
    catch_up: Callable[[object], int] | None = field(default=None, repr=False)
    # exact: once the answer is done, put the question's KV (its cache holds it then) into the
    # prefix cache, so the same question over the same context prefills one token next time
    keep_question: Callable[[object], None] | None = field(default=None, repr=False)
    attention: Scaling | None = None  # ape: how the tokens after the cache attend to it
    recompute: Recompute | None = None  # query: context tokens the prefill recomputes with it

    def attending(self, model):
        """`model`, or the model wrapped to attend as this assembly needs (`ape`)."""
        return attending(model, self.attention)

    @property
    def num_cached(self) -> int:
        return kv.num_cached(self.cache)


def exact(
    model,
    stored: list[kv.Part],
    segments: Sequence[Sequence[int]],
    prefix_cache: PrefixCache,
    root: KVKey,
    question: Sequence[int] = (),
) -> Assembly:
    """`stored`: the prefix and first chunk KV from the store. `segments`: the token ids that
    follow the first chunk (whose entry `root` names), one per further chunk (separator +
    chunk). Matched segments come from `prefix_cache`; `catch_up` takes more of them from it
    if another request computed them before this one's prefill starts (requests over the same
    context admitted together: the first computes, the others reuse); `after_prefill` adds the
    ones the prefill computes. `question`: the prompt's ids after the chunks but its last (the
    question with its template): a segment too, found once `keep_question` has put it there
    after an answer over the same context (vLLM's prefix cache does the same for a repeated
    prompt; a plain layout only: a recurrent state at the question's end cannot be taken out
    of the finished turn). Its last id is always prefilled: it gives the first token."""
    has_state = kv.layout_of(model.config).has_state
    asked = [*segments, question] if question and not has_state else list(segments)
    match = prefix_cache.match(root, asked)
    cache = kv.to_cache([*stored, *match.kvs], model.config)
    stored_tokens = sum(kv.num_tokens(t) for t in stored)
    if has_state:
        computed = extend(model, cache, segments[match.num_segments :])
        if computed:
            prefix_cache.insert(root, segments, [*match.kvs, *computed])
        computed_tokens = sum(entry.num_tokens for entry in computed)
        reused = stored_tokens + match.num_tokens
        return Assembly(cache, reused, computed_tokens, prefix_cache_tokens=match.num_tokens)
    held = list(match.kvs[: len(segments)])  # the segments' KV the cache holds after the stored, in order

    def catch_up(filled_cache) -> int:
        new = prefix_cache.match(root, segments, count=False).kvs[len(held) :]
        if not new:
            return 0
        prefix_cache.hits += len(new)
        prefix_cache.misses -= len(new)
        kv.append(filled_cache, new)
        held.extend(new)
        return sum(kv.num_tokens(t) for t in new)

    def remember(filled_cache) -> None:
        start, kvs = stored_tokens + sum(kv.num_tokens(t) for t in held), []
        for ids in segments[len(held) :]:
            kvs.append(kv.from_cache(filled_cache, 0, start, start + len(ids)))
            start += len(ids)
        prefix_cache.insert(root, segments, [*held, *kvs])

    missing = len(segments) > len(held)
    kept = match.num_segments == len(asked) or len(asked) == len(segments)  # found, or no question
    return Assembly(
        cache,
        stored_tokens + match.num_tokens,
        prefix_cache_tokens=match.num_tokens,
        after_prefill=remember if missing else None,
        catch_up=catch_up if missing else None,
        keep_question=None if kept else _keeper(prefix_cache, root, asked, stored_tokens),
    )


def _keeper(prefix_cache: PrefixCache, root: KVKey, asked: list[Sequence[int]], start: int) -> Callable[[object], None]:
    """`Assembly.keep_question` for the prompt whose segments after the stored `start` tokens
    are `asked` (the question last)."""
    start += sum(len(ids) for ids in asked[:-1])
    end = start + len(asked[-1])

    def keep_question(filled_cache) -> None:
        if kv.num_cached(filled_cache) >= end:  # (a turn cancelled early holds less)
            entry = kv.from_cache(filled_cache, 0, start, end)
            prefix_cache.insert(root, asked, [*(None for _ in asked[:-1]), entry])

    return keep_question


def concat(model, prefix: Entry, pieces: Sequence[Entry]) -> Assembly:
    """`pieces`: entries computed right after `prefix` (stored chunks, and separators between
    them), placed one after another: each piece's keys move from the position it was
    computed at to the position it now starts at (plain layouts only: `check_supported`)."""
    check_supported(model)
    start = num_prefix = prefix.num_tokens
    placed = [prefix]
    for piece in pieces:
        placed.append(Entry.of(shift_positions(piece.kv, start - num_prefix, model)))
        start += piece.num_tokens
    cache = kv.to_cache(placed, model.config)
    return Assembly(cache, reused_tokens=start)


def blended(model, prefix: Entry, pieces: Sequence[Entry], context_ids: Sequence[int], ratio: float) -> Assembly:
    """`concat`, then recompute `ratio` of the tokens after the first chunk (the most deviating
    ones, layer by layer). The first chunk sits where it was computed, after the prefix only:
    its KV is exact."""
    assembly = concat(model, prefix, pieces)
    return _recomputed(assembly, blend(model, assembly.cache, context_ids, _after_first(prefix, pieces), ratio))


def epic(model, prefix: Entry, pieces: Sequence[Entry], context_ids: Sequence[int], ratio: float) -> Assembly:
    """`concat`, then recompute the first `ratio` of every passage after the first: pieces
    come as [passage, separator, passage, separator, passage...]; a separator starts the
    passage after it."""
    assembly = concat(model, prefix, pieces)
    starts, lengths, start = [], [], _after_first(prefix, pieces)
    for i in range(1, len(pieces), 2):
        length = kv.num_tokens(pieces[i]) + kv.num_tokens(pieces[i + 1])  # separator + passage
        starts.append(start)
        lengths.append(length)
        start += length
    return _recomputed(assembly, recompute_starts(model, assembly.cache, context_ids, starts, lengths, ratio))


def attended(
    model,
    prefix: Entry,
    pieces: Sequence[Entry],
    context_ids: Sequence[int],
    question_ids: Sequence[int],
    ratio: float,
) -> Assembly:
    """`concat`, then choose the `ratio` share of the tokens after the first chunk that the
    question attends to most (`query` mode): the prompt's prefill recomputes them as it runs
    (`Assembly.recompute`)."""
    assembly = concat(model, prefix, pieces)
    chosen = attended_recompute(model, assembly.cache, context_ids, question_ids, _after_first(prefix, pieces), ratio)
    assembly.recompute = chosen
    return _recomputed(assembly, BlendResult(0 if chosen is None else chosen.positions.numel()))


def ape(model, prefix: Entry, pieces: Sequence[Entry], temperature: float, scale: float) -> Assembly:
    """`concat`; what attends to the passages after the first does so with APE's scaling. The
    first passage sits where it was computed, right after the prefix, as in a full prefill: it
    is not scaled (with one passage, `ape` is exact)."""
    assembly = concat(model, prefix, pieces)
    if _after_first(prefix, pieces) < assembly.num_cached:
        assembly.attention = Scaling(_after_first(prefix, pieces), assembly.num_cached, temperature, scale)
    return assembly


def _after_first(prefix: Entry, pieces: Sequence[Entry]) -> int:
    """Where the context after the first chunk starts: the first chunk sits where it was
    computed, right after the prefix, so its KV is exact and no approximate mode touches it."""
    return kv.num_tokens(prefix) + kv.num_tokens(pieces[0])


def _recomputed(assembly: Assembly, result) -> Assembly:
    """Count `result`'s recomputed tokens in `assembly` (they are no longer reused)."""
    assembly.recomputed_tokens = result.num_recomputed
    assembly.reused_tokens -= result.num_recomputed
    return assembly
