"""Where a few queries' attention goes: the attention mass that tokens run through a `Probed`
model put on each of the first `num_keys` cached positions, summed over layers, heads and
queries. The question-aware recompute (`ragkv.modes.blend.attended_recompute`, after ProphetKV)
chooses the context tokens to recompute by it.

The forward itself is unchanged (sdpa computes the output); the probe only adds, per layer, a
softmax of the queries' logits over those keys.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

IMPLEMENTATION = "ragkv_probe"


@dataclass
class Probe:
    num_keys: int  # the leading cached positions measured (the context)
    mass: torch.Tensor | None = None  # (num_keys,) float32, once a forward ran


_ACTIVE: contextvars.ContextVar[Probe | None] = contextvars.ContextVar("ragkv_probe", default=None)


def _attention(module, query, key, value, attention_mask, scaling: float, dropout: float = 0.0, **kwargs):
    """sdpa, and while a probe is active, the queries' attention over its keys added to it.
    query (B, H, q, D); key/value (B, Hkv, k, D)."""
    out = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    probe = _ACTIVE.get()
    if probe is not None and key.shape[2] >= probe.num_keys:
        mass = weights(module, query, key, probe.num_keys, scaling).sum(dim=(0, 1, 2))  # (C,)
        probe.mass = mass if probe.mass is None else probe.mass + mass
    return out


def weights(module, query: torch.Tensor, key: torch.Tensor, num_keys: int, scaling: float) -> torch.Tensor:
    """The queries' attention over the first `num_keys` keys alone, (B, H, q, C) float32."""
    keys = repeat_kv(key[:, :, :num_keys], module.num_key_value_groups)  # (B, H, C, D)
    return ((query @ keys.transpose(2, 3)).float() * scaling).softmax(-1)


AttentionInterface.register(IMPLEMENTATION, _attention)
AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)


def probed_forward(model, probe: Probe, **inputs):
    """`model(**inputs)` with every layer's attention measured into `probe`."""
    config = model.config
    before = config._attn_implementation
    token = _ACTIVE.set(probe)
    config._attn_implementation = IMPLEMENTATION
    try:
        return model(**inputs)
    finally:
        config._attn_implementation = before
        _ACTIVE.reset(token)
