"""Where a model runs and in which dtype: "auto" resolved against the machine (torch is asked
whether CUDA is there). Settings keep what the user said; this turns it into a device and a
dtype just before a model loads, so building a setting never imports torch."""

from __future__ import annotations

import dataclasses

from ragkv.core.config import DEVICES, DTYPES, ModelSettings
from ragkv.core.errors import InputError


def resolve_device(device: str) -> str:
    """ "cuda" or "cpu" for `device` ("auto": CUDA where torch sees it). InputError for an
    unknown name, or "cuda" without a CUDA device (said now, not after a model has loaded)."""
    if device not in DEVICES:
        raise InputError(f"unknown --device {device!r}; use one of {', '.join(DEVICES)}")
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise InputError(f"--device cuda, but torch {torch.__version__} sees no CUDA device; use --device cpu or auto")
    if device != "auto":
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(dtype: str, device: str) -> str:
    """'auto' is bfloat16 on CUDA and float32 on CPU (the dtype in which cached == full prefill,
    and the fast one on CPUs without native bf16). An explicit bfloat16 on such a CPU is
    honoured; loading the model warns (ragkv.core.cpu.warn_if_slow)."""
    if dtype == "auto":
        return "bfloat16" if device == "cuda" else "float32"
    if dtype not in DTYPES:
        raise InputError(f"unknown --dtype {dtype!r}; use one of auto, {', '.join(DTYPES)}")
    return dtype


def resolved(settings: ModelSettings) -> ModelSettings:
    """`settings` with its device and dtype resolved on this machine."""
    device = resolve_device(settings.device)
    return dataclasses.replace(settings, device=device, dtype=resolve_dtype(settings.dtype, device))
