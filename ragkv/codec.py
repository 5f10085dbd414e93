"""How KV is stored: as computed (lossless, the default), or compressed (approximate, opt-in).

An encoded entry is a dict of tensors: "" holds the canonical `(L, 2, H, T, D)` data in the
storage dtype; int8 adds its scales. int8 follows KIVI: keys get one scale per channel (key
outliers live in fixed channels), values one scale per token. Symmetric, absmax / 127.
"""

from __future__ import annotations

import torch

from ragkv.errors import StoreFormatError

_FLOAT = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def kv_quant(kv_dtype: str, compute_dtype: str) -> str:
    """The profile's kv_quant (part of every cache key): "none" when stored as computed."""
    return "none" if kv_dtype in ("auto", compute_dtype) else kv_dtype


def encode(kv: torch.Tensor, quant: str) -> dict[str, torch.Tensor]:
    """kv: canonical `(L, 2, H, T, D)`. Returns the tensors to store."""
    if quant == "none":
        return {"": kv}
    if quant in _FLOAT:
        return {"": kv.to(_FLOAT[quant])}
    if quant != "int8":
        raise StoreFormatError(f"unknown KV quantisation {quant!r}: the store was written by a newer ragkv")
    data = kv.float()
    keys, values = data[:, 0], data[:, 1]  # each (L, H, T, D)
    key_scale = keys.abs().amax(dim=2, keepdim=True).clamp_min(1e-8) / 127  # (L, H, 1, D): per channel
    value_scale = values.abs().amax(dim=3, keepdim=True).clamp_min(1e-8) / 127  # (L, H, T, 1): per token
    quantised = torch.stack([(keys / key_scale).round(), (values / value_scale).round()], dim=1)  # (L, 2, H, T, D)
    return {"": quantised.clamp(-127, 127).to(torch.int8), "kscale": key_scale, "vscale": value_scale}


def decode(parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The canonical `(L, 2, H, T, D)` KV in the compute `dtype`, from stored parts."""
    data = parts[""]
    if data.dtype != torch.int8:
        return data if data.dtype == dtype else data.to(dtype)
    keys = data[:, 0].float() * parts["kscale"]  # (L, H, T, D)
    values = data[:, 1].float() * parts["vscale"]
    return torch.stack([keys, values], dim=1).to(dtype)
