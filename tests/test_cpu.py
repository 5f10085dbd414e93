"""bfloat16 on CPUs: `auto` never picks it there; asking for it on a CPU without native bf16
warns once, with the reason."""

from __future__ import annotations

import logging

import pytest

from ragkv import cpu
from ragkv.config import ModelSettings, resolve_dtype


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


def test_explicit_bfloat16_on_a_cpu_without_it_warns_once(no_native_bf16, warnings):
    assert resolve_dtype("bfloat16", "cpu") == "bfloat16"  # still honoured
    assert ModelSettings(device="cpu", dtype="bfloat16").dtype == "bfloat16"
    assert len(warnings) == 1 and "no native bfloat16" in warnings[0] and "--dtype float32" in warnings[0]


def test_no_warning_where_bf16_is_native(monkeypatch, warnings):
    monkeypatch.setattr(cpu, "bf16_features", lambda: ("amx_bf16",))
    cpu.warn_slow_bf16.cache_clear()
    resolve_dtype("bfloat16", "cpu")
    resolve_dtype("bfloat16", "cuda")
    assert not warnings


def test_the_cpu_features_are_read_from_proc_cpuinfo():
    assert set(cpu.bf16_features()) <= set(cpu.BF16_FLAGS)
