"""Reading tokens' KV back out of a serving engine's paged cache, whatever layout its attention
backend keeps inside a block.

Backends lay a block out differently (keys and values split or interleaved, heads outer or
inner, packed for the CPU's matrix units), and the layout is an implementation detail that
changes between releases. So it is not assumed: `PagedLayout.probe` writes numbered values
through the backend's own cache-update op (the write its forward makes) into a scratch
cache of one block, and reads where each (token, head, dim) of the keys and values landed.
`gather` then reads any tokens' KV through that map. An engine whose op is not a fixed
placement within a block fails the probe with a clear error, instead of storing scrambled KV.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

_BASE = 250  # digits of a probe code: integers up to 256 are exact in bf16 and fp16

# write(key, value, cache, slot_mapping): the backend's cache update; key, value (T, H, D)
CacheWrite = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


class LayoutError(RuntimeError):
    """The backend's cache is not laid out as one fixed placement of a block's tokens."""


@dataclass(frozen=True)
class PagedLayout:
    block_dim: int  # the cache tensor's dimension that numbers blocks
    block_size: int
    key_index: torch.Tensor  # (block_size, H, D): where in one block's flattened view each key element is
    value_index: torch.Tensor

    @classmethod
    def probe(
        cls, write: CacheWrite, cache: torch.Tensor, block_dim: int, block_size: int, num_heads: int, head_dim: int
    ) -> PagedLayout:
        """The layout of `cache` (a backend's per-layer paged cache, blocks along `block_dim`),
        found by writing numbered values with `write` into a one-block scratch cache."""
        shape = list(cache.shape)
        shape[block_dim] = 1
        scratch = torch.zeros(shape, dtype=cache.dtype, device=cache.device)
        n = block_size * num_heads * head_dim
        codes = torch.arange(2 * n, device=cache.device)
        slots = torch.arange(block_size, device=cache.device)
        found = torch.zeros(scratch.numel(), dtype=torch.long, device=cache.device)
        used = torch.ones(scratch.numel(), dtype=torch.bool, device=cache.device)
        for digit in range(max(1, math.ceil(math.log(2 * n, _BASE)))):
            scratch.zero_()
            values = ((codes // _BASE**digit) % _BASE + 1).to(cache.dtype)
            write(
                values[:n].view(block_size, num_heads, head_dim),
                values[n:].view(block_size, num_heads, head_dim),
                scratch,
                slots,
            )
            read = scratch.select(block_dim, 0).reshape(-1).float().round().long()
            used &= read > 0
            found += (read - 1).clamp(min=0) * _BASE**digit
        positions = torch.nonzero(used).flatten()
        codes_found = found[positions]
        if positions.numel() != 2 * n or not torch.equal(torch.sort(codes_found).values, codes):
            raise LayoutError(
                f"the attention backend's KV cache {tuple(cache.shape)} does not place each token's keys "
                "and values once in its block"
            )
        index = torch.empty(2 * n, dtype=torch.long, device=cache.device)
        index[codes_found] = positions
        return cls(
            block_dim,
            block_size,
            index[:n].view(block_size, num_heads, head_dim),
            index[n:].view(block_size, num_heads, head_dim),
        )

    def gather(self, cache: torch.Tensor, block_ids: Sequence[int], start: int, end: int) -> torch.Tensor:
        """The KV of token positions start..end-1 of a request whose blocks are `block_ids`,
        `(2, H, T, D)` on the cache's device (a copy: the blocks may be reused after)."""
        first, last = start // self.block_size, (end - 1) // self.block_size
        blocks = torch.tensor(list(block_ids[first : last + 1]), dtype=torch.long, device=cache.device)
        held = cache.movedim(self.block_dim, 0)[blocks].reshape(len(blocks), -1)  # only this request's blocks
        positions = torch.arange(start, end, device=cache.device)
        local = (positions // self.block_size - first).view(-1, 1, 1)
        offsets = positions % self.block_size
        key = held[local, self.key_index.to(cache.device)[offsets]]  # (T, H, D)
        value = held[local, self.value_index.to(cache.device)[offsets]]
        return torch.stack([key, value]).transpose(1, 2)  # (2, H, T, D)


def block_dim_of(cache: torch.Tensor, num_blocks: int) -> int:
    """The dimension of `cache` that numbers its `num_blocks` blocks (LayoutError when that
    is not one dimension)."""
    dims = [i for i, size in enumerate(cache.shape) if size == num_blocks]
    if len(dims) != 1:
        raise LayoutError(
            f"cannot tell which dimension of the KV cache {tuple(cache.shape)} numbers its {num_blocks} blocks"
        )
    return dims[0]
