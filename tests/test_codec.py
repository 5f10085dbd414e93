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
    assert (
        parts[""].dtype == torch.int8
        and parts["kscale"].shape == (4, 3, 1, 16)
        and parts["vscale"].shape == (4, 3, 50, 1)
    )
    back = codec.decode(parts, torch.float32)
    key_error = (back[:, 0] - kv[:, 0]).abs()
    value_error = (back[:, 1] - kv[:, 1]).abs()
    assert (key_error <= parts["kscale"] / 2 + 1e-6).all()  # per channel: outliers do not spoil the rest
    assert (value_error <= parts["vscale"] / 2 + 1e-6).all()  # per token
    assert key_error[..., 0].max() < 0.05  # a normal channel keeps fine resolution beside the outlier
    stored = sum(t.numel() * t.element_size() for t in parts.values())
    assert stored < 0.3 * kv.numel() * kv.element_size()


@pytest.mark.parametrize("quant, bits, most_bytes", [("int4", 4, 0.17), ("int2", 2, 0.11)])
def test_packed_round_trip_stays_within_half_a_step_and_is_small(quant, bits, most_bytes):
    kv = realistic_kv()
    parts = codec.encode(kv, quant)
    assert parts[""].dtype == torch.uint8 and parts[""].shape == (4, 2, 3, 50, 16 * bits // 8)
    assert parts["kstep"].shape == (4, 3, 1, 16) and parts["vstep"].shape == (4, 3, 50, 1)
    back = codec.decode(parts, torch.float32)
    key_error = (back[:, 0] - kv[:, 0]).abs()
    value_error = (back[:, 1] - kv[:, 1]).abs()
    assert (key_error <= parts["kstep"].float() * 0.51 + 1e-4).all()  # per channel
    assert (value_error <= parts["vstep"].float() * 0.51 + 1e-4).all()  # per token
    normal, outlier = key_error[..., 0].max(), key_error[..., 3].max()
    assert normal < outlier / 10  # a normal channel keeps its own resolution beside the outlier
    codes = {int(v) for v in ((kv[:, 1] - parts["vmin"].float()) / parts["vstep"].float()).round().unique()}
    assert min(codes) == 0 and max(codes) == 2**bits - 1  # the full code range is used
    stored = sum(t.numel() * t.element_size() for t in parts.values())
    assert stored < most_bytes * kv.numel() * kv.element_size()  # (D = 16 here; D = 64 gives 0.13x and 0.07x)


def test_packing_needs_a_head_dimension_it_divides():
    from ragkv.errors import InputError

    with pytest.raises(InputError, match="head dimension 6 does not divide by 4"):
        codec.encode(torch.randn(1, 2, 1, 3, 6), "int2")


@pytest.mark.parametrize("quant, tolerance", [("bfloat16", 2**-8), ("float16", 2**-11)])
def test_float_storage_rounds_to_its_precision(quant, tolerance):
    kv = realistic_kv()
    back = codec.decode(codec.encode(kv, quant), torch.float32)
    assert ((back - kv).abs() <= tolerance * kv.abs() + 1e-6).all()


def test_lossless_is_the_default_and_identity():
    kv = realistic_kv()
    assert codec.kv_quant("auto", "float32") == "none" and codec.kv_quant("float32", "float32") == "none"
    assert codec.decode(codec.encode(kv, "none"), torch.float32) is kv


@pytest.mark.parametrize(
    "quant, most_bytes, most_gap", [("int8", 0.3, 0.05), ("int4", 0.2, 0.5)]
)  # head dim 16 here: scales weigh more than at 64
def test_an_integer_store_is_smaller_named_and_close(tiny_llama, corpus, tmp_path, quant, most_bytes, most_gap):
    build_store(corpus, tmp_path / "full", str(tiny_llama))
    build_store(corpus, tmp_path / quant, str(tiny_llama), kv_dtype=quant)
    with open_snapshot(tmp_path / "full") as full, open_snapshot(tmp_path / quant) as small:
        assert small.catalog.reports.kv_bytes() < most_bytes * full.catalog.reports.kv_bytes()
    with ragkv.open(tmp_path / quant, device="cpu") as engine:
        answer = engine.ask(QUESTIONS[0], max_new_tokens=4)
        assert answer.stats.kv_quant == quant and answer.stats.reused_tokens > 0
        gap = engine.first_token_logits(QUESTIONS[0]) - engine.first_token_logits(QUESTIONS[0], use_cache=False)
        assert 0 < gap.abs().max().item() < most_gap  # approximate, and close
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
