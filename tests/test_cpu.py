"""bfloat16 on CPUs: `auto` never picks it there; running a model in it on a CPU without
native bf16 warns once, with the reason, when the weights load; a command that stops on an
error first prints the error alone."""

from __future__ import annotations

import logging

import pytest
import torch

import ragkv
from ragkv import cpu
from ragkv.config import ModelSettings, resolve_dtype
from ragkv.errors import ModelError
from ragkv.model import load_model


@pytest.fixture()
def no_native_bf16(monkeypatch):
    monkeypatch.setattr(cpu, "bf16_features", lambda: ())
    cpu.warn_slow_bf16.cache_clear()
    yield
    cpu.warn_slow_bf16.cache_clear()


def test_auto_is_float32_on_every_cpu():
    assert resolve_dtype("auto", "cpu") == "float32"
    assert ModelSettings(device="cpu").dtype == "float32"


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
    assert ModelSettings(device="cpu", dtype="bfloat16").dtype == "bfloat16"
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
