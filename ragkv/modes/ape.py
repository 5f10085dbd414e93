"""APE-style attention scaling (approximate; after Yang, Chen and Chen, "APE: Faster and Longer
Context-Augmented Generation via Adaptive Parallel Encoding", ICLR 2025).

Passages whose KV was computed apart (each right after the shared prefix, then placed one after
another as `concat` does) draw attention differently from one causal prefill: each kept the
pull of its own start (its own attention sink), so together they take more of a query's
attention than they would. APE corrects this at query time, recomputing nothing: the tokens
after the passages (the question, the answer) see the scaled passages' attention logits
divided by a temperature T and their weights multiplied by a scale S, in one softmax with the
rest:

    weight(key) = exp(logit)              for the prefix, the first passage, the prompt's own tokens
    weight(key) = S * exp(logit / T)      for the passages after the first

The first passage sits where a full prefill puts it, right after the prefix, so it is not
scaled: with one passage, `ape` is exact.

T = S = 1 is plain attention: the same numbers as `concat`. APE's reference code applies the
temperature to the other group and scales a log-sum-exp; on the bundled model that variant
never beat `concat`, and this one did (benchmarks/results/passages.md).

`Scaled(model, scaling)` applies it to every forward made through it, and only those: the
model's attention implementation is switched for the call and restored.
"""

from __future__ import annotations

import contextvars
import math
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

IMPLEMENTATION = "ragkv_ape"


@dataclass(frozen=True)
class Scaling:
    start: int  # the scaled passages' first position in the prompt
    stop: int  # one past their last
    temperature: float  # T: the passages' logits are divided by it (1: none)
    scale: float  # S: the passages' weights are multiplied by it (1: none)


_ACTIVE: contextvars.ContextVar[Scaling | None] = contextvars.ContextVar("ragkv_ape", default=None)


def _attention(module, query, key, value, attention_mask, scaling: float, dropout: float = 0.0, **kwargs):
    """An attention function for transformers: APE's scaled attention while a `Scaled` call is
    active, sdpa otherwise. query (B, H, q, D); key/value (B, Hkv, k, D)."""
    active = _ACTIVE.get()
    if active is None or query.shape[2] == key.shape[2]:  # not scaled, or a prefill from empty (no passages yet)
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    key = repeat_kv(key, module.num_key_value_groups)  # (B, H, k, D)
    value = repeat_kv(value, module.num_key_value_groups)
    logits = (query @ key.transpose(2, 3)).float() * scaling  # (B, H, q, k)
    in_passages = torch.zeros(key.shape[2], dtype=torch.bool, device=query.device)
    in_passages[active.start : active.stop] = True
    logits = torch.where(in_passages, logits / active.temperature + math.log(active.scale), logits)
    allowed = _allowed(attention_mask, query.shape[2], key.shape[2], query.device)  # (B or 1, 1 or H, q, k)
    weights = logits.masked_fill(~allowed, float("-inf")).softmax(-1)
    return (weights @ value.float()).to(query.dtype).transpose(1, 2).contiguous(), None  # (B, q, H, D)


def _allowed(mask: torch.Tensor | None, num_queries: int, num_keys: int, device) -> torch.Tensor:
    """The keys each query may see, as booleans: from transformers' mask (boolean, or additive
    float), or causal after the cache when it gave none."""
    if mask is None:
        queries = torch.arange(num_queries, device=device)[:, None] + (num_keys - num_queries)
        return (torch.arange(num_keys, device=device)[None, :] <= queries)[None, None]
    mask = mask[:, :, :, :num_keys]
    return mask if mask.dtype == torch.bool else mask == 0


AttentionInterface.register(IMPLEMENTATION, _attention)
AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)


class Scaled:
    """`model` whose forwards attend with APE's scaling (`Scaling`): call it as the model."""

    def __init__(self, model, scaling: Scaling):
        self.model, self.scaling = model, scaling

    def __call__(self, *args, **kwargs):
        config = self.model.config
        before = config._attn_implementation
        token = _ACTIVE.set(self.scaling)
        config._attn_implementation = IMPLEMENTATION
        try:
            return self.model(*args, **kwargs)
        finally:
            config._attn_implementation = before
            _ACTIVE.reset(token)

    def __getattr__(self, name):
        return getattr(self.model, name)


def attending(model, scaling: Scaling | None):
    """`model` itself, or wrapped to attend with `scaling` when there is one."""
    return model if scaling is None else Scaled(model, scaling)
