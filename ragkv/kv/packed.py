"""The packed step: one forward over rows that feed different numbers of tokens, decoding rows
one token each and a row being prefilled its chunk of the prompt, with no padding in the
projections and the MLP (vLLM's and nano-vllm's mixed prefill and decode; on a CPU the weights
are read once a step however many tokens it carries, so a prefill rides along a decode step for
little more than its own arithmetic).

The rows' tokens are laid side by side in one sequence of N tokens (`Packing`); each row's new
keys and values go into its slot of the `RaggedBatch` buffers at its own columns, and attention
(`packed_attention`, registered with transformers as an attention implementation) runs per row:
every row's last token of the step in one batched call over the padded slots (as a decode step
does), and the other tokens of a prefilled chunk over their own row, causally. A plain
attention model only (every layer full attention, one key shape, no recurrent state, no
soft-capping or sinks): `packable` says which.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ragkv.kv.layout import layout_of

PACKED = "ragkv_packed"

# Attention of these kinds takes more than queries, keys, values and a mask: a packed step
# would lose it (windows and sinks come with sliding layers, which the layout refuses).
_UNPACKABLE_CONFIG = ("attn_logit_softcapping", "attention_chunk_size")


def packable(model) -> bool:
    """Whether `model` may run packed steps: it attends through transformers' sdpa, every layer
    is full attention with one key shape and no state, and nothing else enters its attention."""
    config = model.config
    if getattr(config, "_attn_implementation", None) not in ("sdpa", PACKED):
        return False
    text = config.get_text_config()
    if any(getattr(text, name, None) for name in _UNPACKABLE_CONFIG):
        return False
    return layout_of(config).is_plain


@dataclass
class Packing:
    """Where each of a packed step's N tokens sits: row `row_of[t]`, column `col_of[t]` of the
    batch's buffers. `last[b]`: the token of row b that picks its next token (its step's last);
    `mask`: `(B, 1, 1, width)`, each row's columns up to and including that token;
    `chunks`: (row, first token in the sequence, row length before the step, tokens) of each
    row that feeds more than one."""

    row_of: torch.Tensor  # (N,)
    col_of: torch.Tensor  # (N,)
    last: torch.Tensor  # (B,)
    mask: torch.Tensor  # (B, 1, 1, width) bool
    width: int
    chunks: list[tuple[int, int, int, int]]

    @classmethod
    def of(cls, lengths: Sequence[int], feeds: Sequence[int], device) -> Packing:
        """`lengths[b]`: row b's tokens before the step; `feeds[b]`: how many it feeds (>= 1)."""
        rows: list[int] = []
        cols: list[int] = []
        last: list[int] = []
        chunks: list[tuple[int, int, int, int]] = []
        offset = 0
        for row, (length, fed) in enumerate(zip(lengths, feeds, strict=True)):
            rows += [row] * fed
            cols += range(length, length + fed)
            if fed > 1:
                chunks.append((row, offset, length, fed))
            offset += fed
            last.append(offset - 1)
        ends = torch.tensor([n + f for n, f in zip(lengths, feeds, strict=True)])
        width = int(ends.max())
        mask = torch.arange(width)[None, :] < ends[:, None]
        return cls(
            torch.tensor(rows, device=device),
            torch.tensor(cols, device=device),
            torch.tensor(last, device=device),
            mask[:, None, None, :].to(device),
            width,
            chunks,
        )

    @property
    def positions(self) -> torch.Tensor:
        """Each token's position: its column (`(1, N)`)."""
        return self.col_of[None, :]


def packed_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Attention for a packed step (`query` `(1, H, N, D)`; `key`/`value` the batch's whole
    buffers `(rows, Hkv, columns, D)`); any other forward goes to transformers' sdpa as is."""
    packing: Packing | None = kwargs.pop("ragkv_packing", None)
    if packing is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    return attend_packed(query[0].transpose(0, 1), key, value, packing, scaling)[None], None


def attend_packed(query: torch.Tensor, key, value, packing: Packing, scaling) -> torch.Tensor:
    """A packed step's attention, `query` `(N, H, D)` -> `(N, H, D)`: every row's last token
    batched over the padded slots, the key heads' query heads together; a chunk's other tokens
    causally over their own row."""
    heads, dim = query.shape[1], query.shape[2]
    kv_heads = key.shape[1]
    rows = packing.last.shape[0]
    out = query.new_empty((query.shape[0], heads, dim))  # (N, H, D)
    last = query[packing.last].reshape(rows, kv_heads, heads // kv_heads, dim)
    attended = F.scaled_dot_product_attention(
        last,
        key[:rows, :, : packing.width],
        value[:rows, :, : packing.width],
        attn_mask=packing.mask,
        scale=scaling,
    )
    out[packing.last] = attended.reshape(rows, heads, dim)
    for row, first, length, fed in packing.chunks:  # a chunk's other tokens, causally over their row
        count = fed - 1
        seen = length + count
        causal = torch.arange(seen, device=query.device)[None, :] <= (
            length + torch.arange(count, device=query.device)[:, None]
        )
        chunk = F.scaled_dot_product_attention(
            query[first : first + count].transpose(0, 1)[None],
            key[row : row + 1, :, :seen],
            value[row : row + 1, :, :seen],
            attn_mask=causal[None, None],
            scale=scaling,
            enable_gqa=kv_heads != heads,
        )
        out[first : first + count] = chunk[0].transpose(0, 1)
    return out


AttentionInterface.register(PACKED, packed_attention)
AttentionMaskInterface.register(PACKED, sdpa_mask)  # other forwards build sdpa's masks, as before


@contextmanager
def attending_packed(model):
    """`model` attends through `packed_attention` inside (a forward without a packing still goes
    to sdpa, so another thread's forward meanwhile computes what it would have)."""
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = PACKED
    try:
        yield
    finally:
        config._attn_implementation = before
