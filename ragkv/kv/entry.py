"""One entry: what T consecutive tokens of a prompt leave in a model's cache, as ragkv keeps it.

- The KV: every token's keys and values in each layer that caches them, one canonical tensor
  per group of layers of one shape (`ragkv.kv.layout.KVGroup`): `(L_g, 2, H, T, D)`, or
  `(L_g, 1, H, T, Dk + Dv)` when keys and values differ in width. Most models have one group.
- The state (models with recurrent layers only): each recurrent layer's state after the
  entry's last token (`ragkv.kv.layout.StateSpec`), by name, without the batch dim, in the
  dtype the model keeps it. A state sums up every token before it (the prefix, and the entries
  before this one), so it is valid at the end only: entries that follow each other join into
  one whose state is the last one's, and a slice that stops before the end has none.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ragkv.kv.layout import TOKEN_DIM

State = Mapping[str, torch.Tensor]  # StateSpec.name -> the state after the last token, no batch dim


@dataclass(frozen=True)
class Entry:
    """KV of T tokens (one tensor per layer group) and, for recurrent layers, the state after them."""

    groups: tuple[torch.Tensor, ...]
    state: State | None = None

    @classmethod
    def of(cls, kv: torch.Tensor, state: State | None = None) -> Entry:
        """An entry of one group, `kv` `(L, 2, H, T, D)` (or packed)."""
        return cls((kv,), state)

    @property
    def kv(self) -> torch.Tensor:
        """The KV of an entry of one group, `(L, 2, H, T, D)` (or packed). The approximate modes,
        the reranker's attention probe and the vLLM connector take only such entries (the layout
        refuses others before they get here)."""
        if len(self.groups) != 1:
            raise ValueError(f"this entry has {len(self.groups)} layer groups; take .groups")
        return self.groups[0]

    @property
    def num_tokens(self) -> int:
        return self.groups[0].shape[TOKEN_DIM]

    @property
    def nbytes(self) -> int:
        tensors = [*self.groups, *(self.state or {}).values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def dtype(self) -> torch.dtype:
        """The KV's dtype (a state keeps its own)."""
        return self.groups[0].dtype

    @property
    def device(self) -> torch.device:
        return self.groups[0].device

    def to(self, device: str | torch.device | None = None, dtype: torch.dtype | None = None) -> Entry:
        """On `device`, its KV in `dtype` (the state stays in the dtype the model keeps it). A copy
        to a GPU is asynchronous (work queued after it on the stream sees the data); one to the
        CPU is not."""
        to_gpu = device is not None and torch.device(device).type != "cpu"
        groups = tuple(g.to(device=device, dtype=dtype, non_blocking=to_gpu) for g in self.groups)
        state = None if self.state is None else {n: t.to(device, non_blocking=to_gpu) for n, t in self.state.items()}
        return Entry(groups, state)

    def clone(self) -> Entry:
        """In new memory (safe to keep when this one views a reused buffer)."""
        state = None if self.state is None else {n: t.clone() for n, t in self.state.items()}
        return Entry(tuple(g.clone() for g in self.groups), state)

    def tokens(self, start: int, stop: int) -> Entry:
        """Tokens `[start, stop)` as contiguous copies; the state only when `stop` is the end."""
        groups = tuple(g[:, :, :, start:stop].contiguous() for g in self.groups)
        return Entry(groups, self.state if stop >= self.num_tokens else None)

    def with_state(self, state: State | None) -> Entry:
        return Entry(self.groups, state)


def joined(entries: Sequence[Entry]) -> Entry:
    """Entries that follow each other as one: the KV along the tokens, the last one's state."""
    if len(entries) == 1:
        return entries[0]
    groups = tuple(torch.cat(parts, dim=TOKEN_DIM) for parts in zip(*(e.groups for e in entries), strict=True))
    return Entry(groups, entries[-1].state)


def num_tokens(entries: Sequence[Entry]) -> int:
    return sum(entry.num_tokens for entry in entries)
