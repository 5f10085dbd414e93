"""Compressed KV storage (opt-in, approximate): round-trip error bounds, bytes saved, and the
stats naming it; the default stays lossless and exact."""

from __future__ import annotations

import pytest
import torch

import ragkv
from ragkv import codec
from store import open_snapshot
from tests.conftest import QUESTIONS, build_store


def realistic_kv(seed=0) -> torch.Tensor:
    """(L, 2, H, T, D) with a few outlier key channels, as real keys have."""
    generator = torch.Generator().manual_seed(seed)
    kv = torch.randn(4, 2, 3, 50, 16, generator=generator)
    kv[:, 0, :, :, 3] *= 20  # an outlier channel in the keys
    return kv


def test_int8_round_trip_stays_within_half_a_step_of_its_scales():
    kv = realistic_kv()
    parts = codec.encode(kv, "int8")
    assert parts[""].dtype == torch.int8 and parts["kscale"].shape == (4, 3, 1, 16) and parts["vscale"].shape == (4, 3, 50, 1)
    back = codec.decode(parts, torch.float32)
    key_error = (back[:, 0] - kv[:, 0]).abs()
    value_error = (back[:, 1] - kv[:, 1]).abs()
    assert (key_error <= parts["kscale"] / 2 + 1e-6).all()  # per channel: outliers do not spoil the rest
    assert (value_error <= parts["vscale"] / 2 + 1e-6).all()  # per token
    assert key_error[..., 0].max() < 0.05  # a normal channel keeps fine resolution beside the outlier
    stored = sum(t.numel() * t.element_size() for t in parts.values())
    assert stored < 0.3 * kv.numel() * kv.element_size()


@pytest.mark.parametrize("quant, tolerance", [("bfloat16", 2 ** -8), ("float16", 2 ** -11)])
def test_float_storage_rounds_to_its_precision(quant, tolerance):
    kv = realistic_kv()
    back = codec.decode(codec.encode(kv, quant), torch.float32)
    assert ((back - kv).abs() <= tolerance * kv.abs() + 1e-6).all()


def test_lossless_is_the_default_and_identity():
    kv = realistic_kv()
    assert codec.kv_quant("auto", "float32") == "none" and codec.kv_quant("float32", "float32") == "none"
    assert codec.decode(codec.encode(kv, "none"), torch.float32) is kv


def test_an_int8_store_is_smaller_named_and_close(tiny_llama, corpus, tmp_path):
    build_store(corpus, tmp_path / "full", str(tiny_llama))
    build_store(corpus, tmp_path / "int8", str(tiny_llama), kv_dtype="int8")
    with open_snapshot(tmp_path / "full") as full, open_snapshot(tmp_path / "int8") as small:
        assert small.catalog.kv_bytes() < 0.3 * full.catalog.kv_bytes()
    with ragkv.open(tmp_path / "int8", device="cpu") as engine:
        answer = engine.ask(QUESTIONS[0], max_new_tokens=4)
        assert answer.stats.kv_quant == "int8" and answer.stats.reused_tokens > 0
        gap = (engine.first_token_logits(QUESTIONS[0]) - engine.first_token_logits(QUESTIONS[0], use_cache=False))
        assert 0 < gap.abs().max().item() < 0.05  # approximate, and close
    with ragkv.open(tmp_path / "full", device="cpu") as engine:
        assert engine.ask(QUESTIONS[0], max_new_tokens=4).stats.kv_quant == "none"


def test_a_store_can_hold_both_and_ask_chooses(tiny_llama, corpus, tmp_path):
    build_store(corpus, tmp_path / "s", str(tiny_llama))
    report = build_store(corpus, tmp_path / "s", str(tiny_llama), kv_dtype="bfloat16")
    assert report.kv_computed == 6 and report.chunks_embedded == 0  # another key: recomputed, chunks kept
    with ragkv.open(tmp_path / "s", device="cpu", kv_dtype="auto") as engine:
        assert engine.ask(QUESTIONS[0], max_new_tokens=2).stats.kv_quant == "none"
    with ragkv.open(tmp_path / "s", device="cpu", kv_dtype="bfloat16") as engine:
        assert engine.ask(QUESTIONS[0], max_new_tokens=2).stats.kv_quant == "bfloat16"
