"""What this CPU can do fast. bfloat16 matmuls are fast only with native bf16 instructions
(AVX512-BF16 or AMX); on a CPU with AVX2 only, torch 2.13 ran a 2048x576x1536 bf16 matmul at
1.2 GFLOP/s against 129 GFLOP/s in float32 (100x slower), and a bf16 ingest of 3,672 tokens at
68 tokens/s against 392 in float32."""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform

log = logging.getLogger("ragkv")

BF16_FLAGS = ("avx512_bf16", "amx_bf16")
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20  # the largest glibc takes on 64-bit: below it, memory comes from the heap
TRIM_THRESHOLD = 1 << 30  # free memory at the heap's top kept, not handed back to the kernel


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


@functools.cache
def keep_freed_memory() -> bool:
    """Once per process, on glibc: keep memory that was freed for the next allocation instead of
    handing it back to the kernel (mallopt: a 32 MiB mmap threshold, a 1 GiB trim threshold).

    Every answer builds a new cache (per layer, a few MB to tens of MB) and frees the last one.
    Under glibc's adaptive defaults such blocks often come as fresh mappings, unmapped again when
    freed, so a request pays a page fault per 4 KiB it writes, the forward's own activations
    included. Measured on the bundled model in float32 at 4k tokens
    (benchmarks/results/cached_path.md): the time to first token from the store fell from
    0.28-0.35 s to 0.20 s, and the same prefill over a cache already in memory from 0.31-0.33 s
    to 0.18 s. PyTorch's CPU tuning guide and vLLM's CPU images swap in tcmalloc for the same
    reason. The cost: the process's resident memory stays at its peak. Left alone when the
    process set glibc's own MALLOC_TRIM_THRESHOLD_ or MALLOC_MMAP_THRESHOLD_, or is not on
    glibc. Returns whether it changed anything."""
    if platform.libc_ver()[0] != "glibc" or any(
        name in os.environ for name in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")
    ):
        return False
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
            libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
        )
    except (OSError, AttributeError):
        return False


def run_aside(function, *args):
    """`function(*args)` in a short-lived thread of its own; returns its result or raises its
    error. For the forwards a model's load and open run once (the layout probe, the self-test):
    run on the calling thread, they left it state that slowed the engine's own thread later
    (torch's OpenMP team and glibc's arena are per thread). Measured with `ragkv serve` on the
    bundled model, 2 cores, two rounds: time to the first token at 1 client 161-176 ms with the
    probes on the main thread, 152-159 ms with them aside, 139-152 ms with none."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ragkv-probe") as pool:
        return pool.submit(function, *args).result()


_OMP_PAUSE_SOFT = 1  # omp_pause_resource_t (OpenMP 5.0): free the threads, keep nothing else


def release_idle_threads() -> bool:
    """Free the calling thread's idle OpenMP worker threads (`omp_pause_resource_all`, soft) in
    every GNU OpenMP runtime the process has loaded (torch's, and FAISS's own copy); they come
    back at this thread's next parallel op. Returns whether the call succeeded in any runtime (a
    thread without a team has nothing to free, and succeeds too). (Only GNU's:
    there the call frees the calling thread's team alone, whatever other threads run; LLVM's and
    Intel's runtimes pause every thread's.)

    GNU OpenMP keeps a team of workers per thread that ever ran a parallel op (torch's CPU
    kernels do, and FAISS's search), and once its threads outnumber the cores, every team's
    workers stop spinning between ops and sleep instead, so each of the hundreds of ops in a
    forward waits for its workers to wake. Call it on a thread that may have run such ops before
    another thread runs the forwards (`Engine.start`: a program that asked or searched on its own
    thread, then batches). Measured on the bundled model, 2 cores, a decode step of 8 rows of ~850
    tokens on a second thread: 126-145 ms while the first thread's team was kept, 104-108 ms once
    freed, as fast as on the first thread itself (108-122 ms); FAISS's copy of the runtime, with a
    team on the first thread after a search, slowed it as much. `benchmarks/admission_profile.py`
    (8 client threads after asks on the main thread): 50.0 tokens/s against 40.6 with the teams
    kept. `ragkv serve` is not affected either way: its main thread runs no parallel op before the
    engine starts (its models load and probe on threads that end)."""
    freed = False
    for path in _loaded_openmp():
        try:
            freed |= ctypes.CDLL(path).omp_pause_resource_all(_OMP_PAUSE_SOFT) == 0
        except (OSError, AttributeError):
            pass
    return freed


def _loaded_openmp() -> list[str]:
    """The GNU OpenMP runtimes this process has loaded (on Linux; none found elsewhere)."""
    found: list[str] = []
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            for line in maps:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if os.path.basename(path).startswith("libgomp") and path not in found:
                    found.append(path)
    except OSError:
        pass
    return found
