"""What a benchmark ran on, in one line for its results file: results differ by machine
(bf16 is 3x faster than float32 on a CPU with AMX and 100x slower on one with AVX2 only)."""

from __future__ import annotations

import os
import platform


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe() -> str:
    """e.g. 'AMD EPYC, 2 cores, torch 2.13.0+cpu (AVX512), bf16: avx512_bf16'."""
    import torch

    from ragkv.core.cpu import bf16_features

    features = bf16_features()
    gpu = f", GPU {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""
    return (
        f"{cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__} "
        f"({torch.backends.cpu.get_cpu_capability()}), native bf16: {', '.join(features) or 'none'}{gpu}"
    )
