"""Move cached keys to other positions: RoPE rotation by the position delta.

A key cached at position p carries the rotation R(p); R(p + d) = R(d) R(p), so rotating it by
R(d) gives the key the same token would have at p + d *if its hidden state were unchanged*.
That holds exactly at layer 0 only; deeper layers also differ because the moved chunk never
attended to the chunks now before it. Used by the approximate `concat` and `blend` modes.
"""

from __future__ import annotations

import torch

from ragkv.core.errors import ModelError
from ragkv.kv.layout import layout_of

# Rope types whose rotation is a fixed per-frequency rotation of the position, so that
# R(p + d) = R(d) R(p) and attention_scaling stays 1. (yarn, longrope, dynamic: not so.)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_type(model) -> str:
    config = model.config.get_text_config()
    parameters = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return parameters.get("rope_type", parameters.get("type", "default"))


def check_supported(model) -> None:
    """Refuse models whose rotary embedding cannot be re-rotated by a position delta, and
    models whose layers are not all full attention of one width (sliding layers, as in Gemma 3,
    may rotate with another base; a latent's rotary part sits inside it; a recurrent state is
    not something a chunk's KV can be moved into)."""
    if not layout_of(model.config).is_plain:
        raise ModelError(
            f"the approximate modes re-rotate stored keys in full-attention layers; {type(model).__name__} has "
            "sliding-window, latent or recurrent layers, or layers of several shapes. Use --mode exact"
        )
    kind = rope_type(model)
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    if kind not in SUPPORTED_ROPE_TYPES or rotary is None or getattr(rotary, "attention_scaling", 1.0) != 1.0:
        raise ModelError(
            f"the concat and blend modes need rotary embeddings of type {', '.join(SUPPORTED_ROPE_TYPES)}; "
            f"this model uses {kind!r}. Use --mode exact"
        )
    config = model.config.get_text_config()
    if getattr(config, "partial_rotary_factor", 1.0) != 1.0:
        raise ModelError("the concat and blend modes do not support partial rotary embeddings; use --mode exact")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def shift_positions(kv: torch.Tensor, delta: int, model) -> torch.Tensor:
    """A copy of canonical `kv` `(L, 2, H, T, D)` with its keys moved `delta` positions on."""
    if delta == 0:
        return kv
    rotary = model.model.rotary_emb
    probe = torch.zeros(1, 1, kv.shape[-1], dtype=torch.float32, device=kv.device)
    cos, sin = rotary(probe, torch.tensor([[delta]], device=kv.device))  # each (1, 1, D)
    keys = kv[:, 0].float()  # (L, H, T, D)
    moved = keys * cos[0, 0] + _rotate_half(keys) * sin[0, 0]
    out = kv.clone()
    out[:, 0] = moved.to(kv.dtype)
    return out
