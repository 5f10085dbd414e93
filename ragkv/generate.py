"""Prefill and decoding over a transformers cache, one token at a time (so tokens can be
streamed and timed). Both the cached and the full-prefill paths go through here, and every
token is chosen by a `ragkv.decoding.Decoder`."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Generator, Sequence

import torch

from ragkv import kv
from ragkv.decoding import DecodeSettings, Decoder, held_back, stop_at


@torch.inference_mode()
def prefill(model, input_ids: Sequence[int], cache) -> torch.Tensor:
    """Run `input_ids` on top of whatever `cache` holds; returns the last position's logits `(V,)`.

    Positions and the causal mask follow `cache.get_seq_length()`, so a cache holding a
    stored prefix continues exactly where the prefix ends. Mutates `cache` (it grows).
    """
    ids = torch.tensor([list(input_ids)], dtype=torch.long, device=model.device)  # (1, T)
    out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    return out.logits[0, -1]


@torch.inference_mode()
def decode(model, first_logits: torch.Tensor, cache, eos_ids: Sequence[int], max_new_tokens: int,
           decoder: Decoder) -> Generator[int, None, str]:
    """Yield tokens chosen by `decoder`, starting from `first_logits`, until an EOS (not
    yielded) or `max_new_tokens`; returns the finish reason, "stop" or "length". Mutates `cache`."""
    logits = first_logits
    eos = set(eos_ids)
    for step in range(max_new_tokens):
        token = decoder.next_token(logits)
        if token in eos:
            return "stop"
        yield token
        if step + 1 < max_new_tokens:
            ids = torch.tensor([[token]], dtype=torch.long, device=model.device)  # (1, 1)
            logits = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
    return "length"


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
            text = text[:len(text) - held_back(text, self.stops)]
        return self._show(text)

    def finish(self) -> str:
        if self.stopped:
            return ""
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        cut = stop_at(text, self.stops) if self.stops else None
        return self._show(text if cut is None else text[:cut])

    def _show(self, text: str) -> str:
        delta, self.text = text[len(self.text):], text
        return delta


@dataclass
class Generated:
    token_ids: list[int]
    text: str
    finish_reason: str
    prefill_s: float
    first_token_s: float  # from `started` (the caller's clock) to the first token
    decode_s: float


def generate(model, tokenizer, cache, live_ids: Sequence[int], eos_ids: Sequence[int], max_new_tokens: int,
             started: float, after_prefill=None, decoding: DecodeSettings | None = None
             ) -> Generator[str, None, Generated]:
    """Prefill `live_ids` on top of `cache`, then decode (`decoding`, default greedy with the
    default repetition controls), yielding text deltas; returns what was generated and when.
    `after_prefill(cache)` runs between the two (it may read the prompt's KV before decoding
    grows the cache)."""
    decoding = decoding or DecodeSettings()
    prefill_start = time.perf_counter()
    logits = prefill(model, live_ids, cache)
    prefill_s = time.perf_counter() - prefill_start
    if after_prefill is not None:
        after_prefill(cache)
    text = TextStream(tokenizer, decoding.stop)
    tokens = decode(model, logits, cache, eos_ids, max_new_tokens, Decoder(decoding))
    decode_start = time.perf_counter()
    first_token_s = 0.0
    while True:
        try:
            token = next(tokens)
        except StopIteration as done:
            finish_reason = done.value
            break
        if not text.token_ids:
            first_token_s = time.perf_counter() - started
        if delta := text.push(token):
            yield delta
        if text.stopped:
            finish_reason = "stop"
            tokens.close()
            break
    if tail := text.finish():
        yield tail
    return Generated(text.token_ids, text.text, finish_reason, prefill_s,
                     first_token_s or time.perf_counter() - started, time.perf_counter() - decode_start)


@dataclass
class BatchGenerated:
    token_ids: list[list[int]]
    texts: list[str]
    finish_reasons: list[str]
    prefill_s: float
    decode_s: float


@torch.inference_mode()
def generate_batch(model, tokenizer, cache, rows: Sequence[Sequence[int]], eos_ids: Sequence[int],
                   max_new_tokens: int, pad_id: int, decoding: DecodeSettings | None = None) -> BatchGenerated:
    """Answers for several prompts that share the `C` tokens `cache` holds (batch B, one row
    per prompt): each row's own ids are prefilled right-padded, then all rows decode together,
    each with its own `Decoder` (so a row's tokens are the ones a lone run would pick). A
    padding mask hides the pad slots and explicit positions keep every row's tokens where a
    single-prompt run would put them."""
    decoding = decoding or DecodeSettings()
    num_rows, num_shared = len(rows), kv.num_cached(cache)
    lengths = torch.tensor([len(r) for r in rows])
    longest = int(lengths.max())
    device = model.device
    ids = torch.full((num_rows, longest), pad_id, dtype=torch.long)  # (B, N)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(list(row))
    real = torch.arange(longest)[None, :] < lengths[:, None]  # (B, N)
    mask = torch.cat([torch.ones(num_rows, num_shared, dtype=torch.long), real.long()], dim=1)  # (B, C + N)
    prefill_start = time.perf_counter()
    logits = model(input_ids=ids.to(device), attention_mask=mask.to(device), cache=cache, use_cache=True).logits
    last = logits[torch.arange(num_rows), lengths - 1]  # (B, V): each row's last real position
    prefill_s = time.perf_counter() - prefill_start

    eos = set(eos_ids)
    decoders = [Decoder(decoding) for _ in rows]
    texts = [TextStream(tokenizer, decoding.stop) for _ in rows]
    positions = num_shared + lengths  # (B,) where each row's next token goes
    reasons = ["length"] * num_rows
    running = [True] * num_rows
    tokens = torch.full((num_rows,), pad_id, dtype=torch.long)  # (B,) finished rows feed a pad
    decode_start = time.perf_counter()
    for step in range(max_new_tokens):
        for i in (i for i in range(num_rows) if running[i]):
            token = decoders[i].next_token(last[i])
            if token in eos:
                reasons[i], running[i] = "stop", False
                continue
            tokens[i] = token
            texts[i].push(token)
            if texts[i].stopped:
                reasons[i], running[i] = "stop", False
        if not any(running) or step + 1 == max_new_tokens:
            break
        mask = torch.cat([mask, torch.ones(num_rows, 1, dtype=torch.long)], dim=1)  # (B, C + N + step + 1)
        out = model(input_ids=tokens[:, None].to(device), attention_mask=mask.to(device),
                    position_ids=positions[:, None].to(device), cache=cache, use_cache=True)
        last = out.logits[:, -1]
        positions = positions + 1
    for text in texts:
        text.finish()
    return BatchGenerated([t.token_ids for t in texts], [t.text for t in texts], reasons, prefill_s,
                          time.perf_counter() - decode_start)
