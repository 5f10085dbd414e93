"""How the next token is chosen from the logits: repetition controls, greedy or seeded
sampling, stop strings. One `Decoder` per answer; the cached path, `--no-cache`, batches and
the service all decode through it, so equal logits give equal tokens everywhere.

The repetition controls look at the answer's own tokens only, never at the prompt: a RAG
answer should copy names, commands and numbers from its context freely, but not repeat
itself (a 135M model otherwise loops on the same sentence until `max_new_tokens`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopPLogitsWarper,
)

from ragkv.core.config import DecodeSettings


class Decoder:
    """Picks one answer's tokens. `next_token(logits)` takes the `(V,)` logits after the
    tokens picked so far and returns the next id (and remembers it)."""

    def __init__(self, settings: DecodeSettings, device="cpu"):
        self.settings = settings
        self.token_ids: list[int] = []
        warpers = LogitsProcessorList()  # sampling's, after the repetition controls
        if not settings.is_greedy:
            warpers.append(TemperatureLogitsWarper(settings.temperature))
            if settings.top_p < 1.0:
                warpers.append(TopPLogitsWarper(settings.top_p))
        self._warpers = warpers
        self._generator = None
        if not settings.is_greedy:
            self._generator = torch.Generator(device="cpu")
            if settings.seed is not None:
                self._generator.manual_seed(settings.seed)
            else:
                self._generator.seed()

    def next_token(self, logits: torch.Tensor) -> int:
        scores = self._controlled(logits.float().reshape(-1))  # (V,)
        if self._generator is None:
            token = first_max(scores)
        else:
            ids = torch.tensor([self.token_ids], dtype=torch.long, device=scores.device)  # (1, N) the answer so far
            probs = torch.softmax(self._warpers(ids, scores[None])[0].cpu(), dim=-1)  # (V,)
            token = int(torch.multinomial(probs, 1, generator=self._generator))
        self.token_ids.append(token)
        return token

    def _controlled(self, scores: torch.Tensor) -> torch.Tensor:
        """`scores` `(V,)` after the repetition controls: what transformers'
        `RepetitionPenaltyLogitsProcessor` then `NoRepeatNGramLogitsProcessor` return, the same
        operations on the same entries (tested equal), on the answer's few ids instead of masks
        over the whole vocabulary (a pick took ~280 us through them, ~45 us here). A copy when
        anything changes: `scores` may view the caller's logits."""
        ids, vocab = self.token_ids, scores.shape[0]
        penalty = self.settings.repetition_penalty
        banned = repeating(ids, self.settings.no_repeat_ngram, vocab)
        penalised = bool(ids) and penalty != 1.0
        if penalised or banned:
            scores = scores.clone()
        if penalised:
            seen = torch.tensor(sorted({i for i in ids if i < vocab}), dtype=torch.long, device=scores.device)
            picked = scores[seen]
            scores[seen] = torch.where(picked < 0, picked * penalty, picked / penalty)
        if banned:
            scores[torch.tensor(banned, dtype=torch.long, device=scores.device)] = -float("inf")
        return scores


def repeating(ids: Sequence[int], n: int, vocab: int) -> list[int]:
    """The ids (below `vocab`) that would complete an n-gram `ids` already holds: each earlier
    window whose first n - 1 ids equal the last n - 1 bans its own last id (0: off)."""
    if not n or len(ids) < n:
        return []
    prefix = list(ids[len(ids) - n + 1 :])
    windows = range(len(ids) - n + 1)
    return sorted({ids[i + n - 1] for i in windows if list(ids[i : i + n - 1]) == prefix and ids[i + n - 1] < vocab})


def first_max(scores: torch.Tensor) -> int:
    """The greedy pick: the first index of the largest of `scores` `(V,)` (a NaN counts as the
    largest), as `torch.argmax` gives; on the CPU through numpy's, which is vectorised (~4 us
    for 49k scores against ~75 us)."""
    if scores.device.type == "cpu":
        return int(scores.numpy().argmax())
    return int(scores.argmax())


def stop_at(text: str, stops: Sequence[str]) -> int | None:
    """Where the first stop string in `text` begins, or None."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters of `text` might be the start of a stop string (not yet
    safe to show)."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest
