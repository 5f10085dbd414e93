"""What this CPU can do fast. bfloat16 matmuls are fast only with native bf16 instructions
(AVX512-BF16 or AMX); on a CPU with AVX2 only, torch 2.13 ran a 2048x576x1536 bf16 matmul at
1.2 GFLOP/s against 129 GFLOP/s in float32 (100x slower), and a bf16 ingest of 3,672 tokens at
68 tokens/s against 392 in float32."""

from __future__ import annotations

import functools
import logging

log = logging.getLogger("ragkv")

BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.cache
def bf16_features() -> tuple[str, ...]:
    """The native bf16 instruction sets this CPU reports (empty when none, or not Linux)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return tuple(f for f in BF16_FLAGS if f in flags)
    except OSError:
        pass
    return ()


def has_fast_bf16() -> bool:
    return bool(bf16_features())


def warn_if_slow(dtype: str, device: str) -> None:
    """Warn (once per process) when a model is about to run in bfloat16 on a CPU without native
    bf16. Called where the weights load, not where the dtype is parsed: a command that stops on
    an error before any compute prints the error alone."""
    if dtype == "bfloat16" and device == "cpu" and not has_fast_bf16():
        warn_slow_bf16()


@functools.cache
def warn_slow_bf16() -> None:
    """Once per process: bfloat16 was asked for on a CPU without native bf16."""
    log.warning(
        "warning: this CPU has no native bfloat16 (no AVX512-BF16 or AMX): bfloat16 runs 5-100x slower "
        "than float32 here (a measured 2048x576x1536 matmul: 1.2 vs 129 GFLOP/s); use --dtype float32"
    )
