"""Prefill and decoding over a transformers cache, one token at a time (so tokens can be
streamed and timed). Both the cached and the full-prefill paths go through here, and every
token is chosen by a `ragkv.model.decoding.Decoder`."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from ragkv.model.decoding import Decoder, DecodeSettings, held_back, stop_at

if TYPE_CHECKING:
    from ragkv.model.llm import LoadedModel


class Recompute(Protocol):
    """Context tokens recomputed in the prompt's own prefill (the query mode's
    `ragkv.modes.blend.Recompute`, a mode above this layer)."""

    def prefill(self, model, input_ids: Sequence[int], cache) -> torch.Tensor: ...


@torch.inference_mode()
def prefill(model, input_ids: Sequence[int], cache, recompute: Recompute | None = None) -> torch.Tensor:
    """Run `input_ids` on top of whatever `cache` holds; returns the last position's logits `(V,)`.

    Positions and the causal mask follow `cache.get_seq_length()`, so a cache holding a
    stored prefix continues exactly where the prefix ends. Mutates `cache` (it grows).
    `recompute` (query mode): context tokens recomputed in the same forward (`Recompute.prefill`).
    """
    if recompute is not None:
        return recompute.prefill(model, input_ids, cache)
    ids = torch.tensor([list(input_ids)], dtype=torch.long, device=model.device)  # (1, T)
    out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    return out.logits[0, -1]


@torch.inference_mode()
def step(model, token: int, cache) -> torch.Tensor:
    """Feed one chosen token; returns the next position's logits `(V,)`. Mutates `cache`."""
    ids = torch.tensor([[token]], dtype=torch.long, device=model.device)  # (1, 1)
    return model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1]


class TextStream:
    """Turns token ids into text deltas, holding back an incomplete UTF-8 character and any
    tail that may be the start of a stop string; `stopped` once a stop string appeared (the
    text ends before it)."""

    def __init__(self, tokenizer, stops: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stops = tuple(stops)
        self.token_ids: list[int] = []
        self.text = ""  # shown so far
        self.stopped = False

    def push(self, token: int) -> str:
        self.token_ids.append(token)
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        if self.stops:
            cut = stop_at(text, self.stops)
            if cut is not None:
                self.stopped = True
                return self._show(text[:cut])
            text = text[: len(text) - held_back(text, self.stops)]
        return self._show(text)

    def finish(self) -> str:
        if self.stopped:
            return ""
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        cut = stop_at(text, self.stops) if self.stops else None
        return self._show(text if cut is None else text[:cut])

    def _show(self, text: str) -> str:
        delta, self.text = text[len(self.text) :], text
        return delta


@dataclass
class Generated:
    token_ids: list[int]
    text: str
    finish_reason: str
    prefill_s: float
    first_token_s: float  # from `started` (the caller's clock) to the first token
    decode_s: float


class DecodeState:
    """One sequence's decoding, whatever runs its forwards (a row of the engine's batch, or
    `decode_alone`): picks each token with its own `Decoder`, turns tokens into text
    (`delta`: what the last token added), and knows when it is finished: an EOS (not kept),
    a stop string, or `budget` tokens."""

    def __init__(self, tokenizer, eos_ids: Sequence[int], budget: int, decoding: DecodeSettings, started: float):
        self.decoder = Decoder(decoding)
        self.text = TextStream(tokenizer, decoding.stop)
        self.eos = set(eos_ids)
        self.budget = budget
        self.started = started  # the caller's clock: first-token time counts from here
        self.prefill_s = 0.0
        self.first_token_s = 0.0
        self.decode_start = 0.0
        self.next_token: int | None = None  # picked, not yet fed
        self.delta = ""
        self.finish_reason = ""  # "stop", "length", or "cancelled" (set by the caller)

    @property
    def token_ids(self) -> list[int]:
        return self.text.token_ids

    def to_feed(self) -> int:
        """The token picked last: what the next forward feeds."""
        if self.next_token is None:
            raise RuntimeError("no token has been picked yet: take the prefill's logits first")
        return self.next_token

    def take(self, logits: torch.Tensor) -> bool:
        """Pick the next token from `logits` `(V,)`; returns whether the sequence is finished."""
        if not self.decode_start:
            self.decode_start = time.perf_counter()
        token = self.decoder.next_token(logits)
        self.delta = ""
        if token in self.eos:
            self.finish_reason = "stop"
            return True
        if not self.text.token_ids:
            self.first_token_s = time.perf_counter() - self.started
        self.delta = self.text.push(token)
        self.next_token = token
        if self.text.stopped:
            self.finish_reason = "stop"
        elif len(self.text.token_ids) >= self.budget:
            self.finish_reason = "length"
        return bool(self.finish_reason)

    def finish(self) -> str:
        """The text held back until the end (an incomplete character, a possible stop string's start)."""
        return self.text.finish() if self.text.token_ids else ""

    def result(self) -> Generated:
        now = time.perf_counter()
        return Generated(
            self.text.token_ids,
            self.text.text,
            self.finish_reason,
            self.prefill_s,
            self.first_token_s or now - self.started,
            now - (self.decode_start or now),
        )


def start_decoding(lm: LoadedModel, budget: int, decoding: DecodeSettings, started: float) -> DecodeState:
    """A new sequence's `DecodeState` for `lm`: the one place one is made, for the engine's
    rows and `decode_alone` alike."""
    return DecodeState(lm.tokenizer, lm.facts.eos_ids, budget, decoding, started)


def decode_alone(
    lm: LoadedModel,
    cache,
    live_ids: Sequence[int],
    max_new_tokens: int,
    after_prefill=None,
    decoding: DecodeSettings | None = None,
    started: float | None = None,
) -> Generated:
    """Prefill `live_ids` on top of `cache`, then decode one token per forward (`decoding`,
    default greedy with the default repetition controls) until finished. No scheduler: the
    plain loop that answers are checked against (tests, benchmarks); answers themselves go
    through ragkv.engine. `after_prefill(cache)` runs between the two; the first token's time
    counts from `started` (the caller's clock; default now). Mutates `cache`."""
    prefill_start = time.perf_counter()
    state = start_decoding(lm, max_new_tokens, decoding or DecodeSettings(), started or prefill_start)
    logits = prefill(lm.model, live_ids, cache)
    state.prefill_s = time.perf_counter() - prefill_start
    if after_prefill is not None:
        after_prefill(cache)
    while not state.take(logits):
        logits = step(lm.model, state.to_feed(), cache)
    state.finish()
    return state.result()
