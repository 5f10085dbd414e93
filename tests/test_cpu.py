"""bfloat16 on CPUs: `auto` never picks it there; running a model in it on a CPU without
native bf16 warns once, with the reason, when the weights load; a command that stops on an
error first prints the error alone."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

import ragkv
from ragkv.core import cpu
from ragkv.core.config import ModelSettings
from ragkv.core.errors import InputError, ModelError
from ragkv.model.device import resolve_dtype, resolved
from ragkv.model.llm import load_model


@pytest.fixture()
def no_native_bf16(monkeypatch):
    monkeypatch.setattr(cpu, "bf16_features", lambda: ())
    cpu.warn_slow_bf16.cache_clear()
    yield
    cpu.warn_slow_bf16.cache_clear()


def test_auto_is_float32_on_every_cpu():
    assert resolve_dtype("auto", "cpu") == "float32"
    assert resolved(ModelSettings(device="cpu")).dtype == "float32"


def test_settings_are_checked_without_torch_and_resolved_as_a_model_loads(corpus, tmp_path):
    """Building settings imports no torch (a typo is still refused at once); "auto" and a
    missing CUDA are settled on the machine that loads the model, before it loads."""
    code = (
        "import sys; from ragkv.core.config import ModelSettings, AskSettings, IngestSettings; "
        "ModelSettings(device='cuda'); AskSettings(); IngestSettings(); print('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"
    with pytest.raises(InputError, match="unknown --device 'gpu'"):
        ModelSettings(device="gpu")
    assert ModelSettings().device == "auto" and resolved(ModelSettings()).device in ("cpu", "cuda")
    if not torch.cuda.is_available():
        with pytest.raises(InputError, match="sees no CUDA device"):
            ragkv.ingest([corpus], tmp_path / "store", model=ModelSettings(device="cuda"))
        assert not (tmp_path / "store").exists()


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture()
def warnings():
    handler, logger = _Collect(), logging.getLogger("ragkv")
    logger.addHandler(handler)
    yield handler.messages
    logger.removeHandler(handler)


def test_bfloat16_on_a_cpu_without_it_warns_once_when_the_weights_load(no_native_bf16, warnings, tiny_llama):
    assert resolve_dtype("bfloat16", "cpu") == "bfloat16"  # still honoured
    assert resolved(ModelSettings(device="cpu", dtype="bfloat16")).dtype == "bfloat16"
    assert not warnings  # parsing the dtype runs nothing
    load_model(str(tiny_llama), "cpu", "bfloat16", weights=False)
    assert not warnings  # no weights, no compute
    for _ in range(2):
        assert load_model(str(tiny_llama), "cpu", "bfloat16").model.dtype == torch.bfloat16
    assert len(warnings) == 1 and "no native bfloat16" in warnings[0] and "--dtype float32" in warnings[0]


def test_a_store_without_bfloat16_kv_is_refused_before_the_model_loads(no_native_bf16, warnings, tiny_store):
    with pytest.raises(ModelError, match="has no KV for model .* in bfloat16"):
        ragkv.open(tiny_store, device="cpu", dtype="bfloat16")
    assert not warnings  # the error alone: nothing was about to run in bfloat16


def test_no_warning_where_bf16_is_native(monkeypatch, warnings, tiny_llama):
    monkeypatch.setattr(cpu, "bf16_features", lambda: ("amx_bf16",))
    cpu.warn_slow_bf16.cache_clear()
    load_model(str(tiny_llama), "cpu", "bfloat16")
    cpu.warn_if_slow("bfloat16", "cuda")
    assert not warnings


def test_the_cpu_features_are_read_from_proc_cpuinfo():
    assert set(cpu.bf16_features()) <= set(cpu.BF16_FLAGS)


ROUNDS = """
import resource, torch
from ragkv.core.cpu import keep_freed_memory
print(keep_freed_memory())
def allocate_and_free(i):  # 16 blocks of 4 to 16 MB (160 MB), as caches' layers are allocated
    blocks = [torch.ones((1 + (i + j) % 4) << 20) for j in range(16)]
    del blocks
for i in range(2):
    allocate_and_free(i)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for i in range(2, 6):
    allocate_and_free(i)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(__import__("platform").libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_the_engine_process_reuses_freed_memory_instead_of_faulting_fresh_pages():
    """What `keep_freed_memory` is for: 160 MB allocated and freed four times over (163,840 pages
    of 4 KiB) faults a handful of pages once it is on (measured 0 to 4,096). A process that set
    glibc's own variable is left alone: here glibc's starting mmap threshold (128 KiB), held
    fixed, under which every block is a fresh mapping and the rounds fault every page again.
    (glibc's adaptive default falls anywhere from 4,096 to 157,572 faults here, so it is not the
    reference.)"""
    import os
    import subprocess
    import sys

    def run(**env) -> list[str]:
        done = subprocess.run(
            [sys.executable, "-c", ROUNDS], capture_output=True, text=True, check=True, env={**os.environ, **env}
        )
        return done.stdout.split()

    pages = 4 * 160 << 20 >> 12
    changed, kept = run()
    unchanged, faulted = run(MALLOC_MMAP_THRESHOLD_="131072")
    assert (changed, unchanged) == ("True", "False")
    assert int(kept) < pages // 8 and int(faulted) > pages // 2, (kept, faulted)


TEAMS = """
import os, torch
from ragkv.core.cpu import release_idle_threads
torch.set_num_threads(2)
def threads():
    return len(os.listdir("/proc/self/task"))
alone = threads()
(torch.ones(1 << 22) * 2).sum()  # a parallel op: this thread's OpenMP team (one worker)
with_team = threads()
print(with_team - alone, release_idle_threads(), threads() - alone)
(torch.ones(1 << 22) * 2).sum()
print(threads() - alone)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_the_thread_that_starts_the_engine_frees_its_idle_openmp_workers():
    """What `release_idle_threads` (called by Engine.start) is for: the thread that ran torch's
    parallel ops keeps a worker thread; freed, it is gone (and comes back at the next parallel op
    of that thread). A fresh process of two torch threads (xdist's workers run one)."""
    if not cpu._loaded_openmp():
        pytest.skip("torch here loads no OpenMP runtime")
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    done = subprocess.run([sys.executable, "-c", TEAMS], capture_output=True, text=True, check=True, env=env)
    first, again = done.stdout.splitlines()
    assert first.split() == ["1", "True", "0"], done.stdout
    assert again == "1"
