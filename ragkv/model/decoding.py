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
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
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
        processors = LogitsProcessorList()
        if settings.repetition_penalty != 1.0:
            processors.append(RepetitionPenaltyLogitsProcessor(settings.repetition_penalty))
        if settings.no_repeat_ngram:
            processors.append(NoRepeatNGramLogitsProcessor(settings.no_repeat_ngram))
        if not settings.is_greedy:
            processors.append(TemperatureLogitsWarper(settings.temperature))
            if settings.top_p < 1.0:
                processors.append(TopPLogitsWarper(settings.top_p))
        self._processors = processors
        self._generator = None
        if not settings.is_greedy:
            self._generator = torch.Generator(device="cpu")
            if settings.seed is not None:
                self._generator.manual_seed(settings.seed)
            else:
                self._generator.seed()

    def next_token(self, logits: torch.Tensor) -> int:
        scores = logits.float().reshape(1, -1)  # (1, V)
        if self._processors:
            ids = torch.tensor([self.token_ids], dtype=torch.long, device=scores.device)  # (1, N) the answer so far
            scores = self._processors(ids, scores)
        if self._generator is None:
            token = int(scores.argmax())
        else:
            probs = torch.softmax(scores[0].cpu(), dim=-1)  # (V,)
            token = int(torch.multinomial(probs, 1, generator=self._generator))
        self.token_ids.append(token)
        return token


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
