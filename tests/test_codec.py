"""Compressed KV storage (opt-in, approximate): round-trip error bounds, bytes saved, and the
stats naming it; the default stays lossless and exact."""

from __future__ import annotations

import pytest
import torch

import ragkv
from ragkv.kv import codec
from ragkv.kv.entry import Entry
from ragkv.kv.layout import KVGroup, KVLayout, StateSpec
from ragkv.store import open_snapshot
from tests.conftest import QUESTIONS, build_store


def realistic_kv(seed=0) -> torch.Tensor:
    """(L, 2, H, T, D) with a few outlier key channels, as real keys have."""
    generator = torch.Generator().manual_seed(seed)
    kv = torch.randn(4, 2, 3, 50, 16, generator=generator)
    kv[:, 0, :, :, 3] *= 20  # an outlier channel in the keys
    return kv


def test_int8_round_trip_stays_within_half_a_step_of_its_scales():
    kv = realistic_kv()
    parts = codec.encode(Entry.of(kv), "int8")
    assert (
        parts[""].dtype == torch.int8
        and parts["kscale"].shape == (4, 3, 1, 16)
        and parts["vscale"].shape == (4, 3, 50, 1)
    )
    back = codec.decode(parts, torch.float32).kv
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
    parts = codec.encode(Entry.of(kv), quant)
    assert parts[""].dtype == torch.uint8 and parts[""].shape == (4, 2, 3, 50, 16 * bits // 8)
    assert parts["kstep"].shape == (4, 3, 1, 16) and parts["vstep"].shape == (4, 3, 50, 1)
    back = codec.decode(parts, torch.float32).kv
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
    from ragkv.core.errors import InputError

    with pytest.raises(InputError, match="head dimension 6 does not divide by 4"):
        codec.encode(Entry.of(torch.randn(1, 2, 1, 3, 6)), "int2")


@pytest.mark.parametrize("quant, tolerance", [("bfloat16", 2**-8), ("float16", 2**-11)])
def test_float_storage_rounds_to_its_precision(quant, tolerance):
    kv = realistic_kv()
    back = codec.decode(codec.encode(Entry.of(kv), quant), torch.float32).kv
    assert ((back - kv).abs() <= tolerance * kv.abs() + 1e-6).all()


def test_lossless_is_the_default_and_identity():
    kv = realistic_kv()
    assert codec.kv_quant("auto", "float32") == "none" and codec.kv_quant("float32", "float32") == "none"
    assert codec.decode(codec.encode(Entry.of(kv), "none"), torch.float32).kv is kv


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_entry_read_straight_into_the_cache_equals_one_read_then_copied(tmp_path, dtype):
    """The exact path reads a plain entry from its shard into the cache's layers (no buffer in
    between): the cache holds the same bytes, in every batch row, after what comes before it;
    the RAM tier's copy is the entry; a flipped bit fails the checksum; an encoded entry is
    read the usual way."""
    from types import SimpleNamespace

    from transformers import LlamaConfig

    from ragkv.core.errors import StoreCorruptError
    from ragkv.kv import cache as kv
    from ragkv.store import ShardReader, ShardWriter
    from tests.conftest import flip_bit_of_entry

    config = LlamaConfig(num_hidden_layers=4, num_attention_heads=3, num_key_value_heads=3, hidden_size=48)
    before, stored = realistic_kv(1).to(dtype), realistic_kv(2).to(dtype)  # (4, 2, 3, 50, 16)
    writer = ShardWriter(tmp_path, max_bytes=1 << 30, metadata={})
    writer.add("plain", stored)
    writer.add("int8", codec.encode(Entry.of(stored), "int8"))
    sealed = {e.name: SimpleNamespace(shard=e.shard, tensor=e.name, checksum=e.checksum) for e in writer.flush()}
    reader = ShardReader(tmp_path)
    assert codec.deferred(reader, sealed["int8"], dtype, "cpu") is None
    assert codec.deferred(reader, sealed["plain"], torch.float16, "cpu") is None  # not the compute dtype
    later = codec.deferred(reader, sealed["plain"], dtype, "cpu")
    assert later is not None and later.shape == stored.shape
    kept = []
    later.keep = kept.append
    direct = kv.to_cache([Entry.of(before), later], config, batch_size=2)
    copied = kv.to_cache([Entry.of(before), codec.read(reader, sealed["plain"], dtype)], config, batch_size=2)
    for row in (0, 1):
        assert torch.equal(kv.from_cache(direct, row).kv, kv.from_cache(copied, row).kv)
        assert torch.equal(kv.from_cache(direct, row, 50).kv, stored)
    assert len(kept) == 1 and torch.equal(kept[0].kv, stored)
    flip_bit_of_entry(tmp_path / sealed["plain"].shard, "plain")
    broken = codec.deferred(ShardReader(tmp_path), sealed["plain"], dtype, "cpu")
    assert broken is not None
    with pytest.raises(StoreCorruptError, match="checksum"):
        kv.to_cache([Entry.of(before), broken], config)


@pytest.mark.parametrize("quant", ["none", "bfloat16"])
def test_a_sliding_layer_stores_only_the_window_a_continuation_reads(quant, tmp_path):
    from ragkv.store.kv.shards import ShardReader, ShardWriter

    kv = torch.randn(3, 2, 2, 40, 8)  # (L, 2, H, T, D): a sliding layer, a full one, a sliding one
    windows = (12, None, 12)
    parts = codec.encode(Entry.of(kv), quant, KVLayout.uniform(2, 8, 8, windows))
    assert parts["slid"].shape == (2, 2, 2, 11, 8) and parts[""].shape == (1, 2, 2, 40, 8)  # window - 1 kept
    stored = sum(t.numel() * t.element_size() for t in parts.values())
    assert stored < 0.55 * kv.numel() * parts[""].element_size()  # 1 full layer of 3, 11 of 40 tokens in 2
    dtype = torch.float32 if quant == "none" else torch.bfloat16
    back = codec.decode(parts, dtype).kv
    assert back.shape == kv.shape and back.dtype == dtype
    assert torch.equal(back[1], kv[1].to(dtype))  # the full layer whole
    assert torch.equal(back[[0, 2], :, :, 29:], kv[[0, 2], :, :, 29:].to(dtype))  # the window's tail
    assert not back[[0, 2], :, :, :29].any()  # zeros where no query looks
    short = Entry.of(kv[:, :, :, :11])
    assert set(codec.encode(short, quant, KVLayout.uniform(2, 8, 8, windows))) == {""}  # within the window: whole
    assert set(codec.encode(Entry.of(kv), quant)) == {""}  # no layout given: whole
    every = codec.encode(Entry.of(kv), quant, KVLayout.uniform(2, 8, 8, (12, 12, 12)))  # every layer slides: no full
    writer = ShardWriter(tmp_path, 1 << 20, {"layout": "L2HTD"})
    (sealed,) = [*writer.add("entry", every), *writer.flush()]
    read = ShardReader(tmp_path).read_parts(sealed.shard, sealed.name, sealed.checksum)
    assert sealed.num_tokens == 40
    assert read[""].shape == (0, 2, 2, 40, 8)
    assert torch.equal(codec.decode(read, dtype).kv[:, :, :, 29:], kv[:, :, :, 29:].to(dtype))


def test_int_quantisation_keeps_every_token_of_a_sliding_layer():
    kv = torch.randn(2, 2, 2, 40, 8)
    assert "slid" not in codec.encode(Entry.of(kv), "int8", KVLayout.uniform(2, 8, 8, (12, None)))


def _hybrid_layout() -> KVLayout:
    """Layer 0 sliding (2 heads of 8), 1 recurrent, 2 full of other heads (1 of 16) with a state too."""
    groups = (KVGroup((0,), 2, 8, 8, (12,)), KVGroup((2,), 1, 16, 16, (None,)))
    states = (
        StateSpec(1, "conv", 0, (24, 4), "bfloat16"),
        StateSpec(1, "recurrent", 0, (2, 8, 8), "float32"),
        StateSpec(2, "conv", 0, (24, 4), "bfloat16"),
    )
    return KVLayout(groups, 3, states)


def _hybrid_entry(layout: KVLayout, tokens: int = 40) -> Entry:
    generator = torch.Generator().manual_seed(3)
    groups = tuple(torch.randn(g.shape(tokens), generator=generator) for g in layout.groups)
    state = {s.name: torch.randn(s.shape, generator=generator).to(s.torch_dtype) for s in layout.states}
    return Entry(groups, state)


@pytest.mark.parametrize("quant", ["none", "bfloat16", "int8"])
def test_layer_groups_and_recurrent_states_are_stored_each_as_it_is(quant, tmp_path):
    """Gemma 4's groups of other head sizes and a hybrid model's states go through the codec and
    a shard: each group encoded as asked (its sliding layer windowed), every state bitwise, in
    the dtype the model keeps it, whatever the KV's quantisation; the entry's bytes count both."""
    from ragkv.store.kv.shards import ShardReader, ShardWriter

    layout = _hybrid_layout()
    entry = _hybrid_entry(layout)
    parts = codec.encode(entry, quant, layout)
    assert {"state.1.conv.0", "state.1.recurrent.0", "state.2.conv.0"} <= set(parts)
    assert any(name.startswith("g1") for name in parts) and "" in parts
    writer = ShardWriter(tmp_path, 1 << 20, {"layout": layout.name})
    (sealed,) = [*writer.add("entry", parts), *writer.flush()]
    assert sealed.num_tokens == 40
    assert sealed.nbytes == sum(t.numel() * t.element_size() for t in parts.values())
    back = codec.decode(ShardReader(tmp_path).read_parts(sealed.shard, sealed.name, sealed.checksum), torch.float32)
    assert back.num_tokens == 40 and len(back.groups) == 2
    assert back.state is not None and set(back.state) == set(entry.state)
    for name, state in entry.state.items():
        assert back.state[name].dtype == state.dtype and torch.equal(back.state[name], state)  # lossless
    if quant == "none":
        assert torch.equal(back.groups[1], entry.groups[1])
        assert torch.equal(back.groups[0][:, :, :, 29:], entry.groups[0][:, :, :, 29:])  # the window's tail
    else:
        assert torch.allclose(back.groups[1], entry.groups[1], atol=0.1, rtol=0.05)


def test_an_entry_joins_its_successors_keeping_the_last_state_and_a_slice_has_none():
    from ragkv.kv.entry import joined

    layout = _hybrid_layout()
    first, second = _hybrid_entry(layout, 10), _hybrid_entry(layout, 7)
    both = joined([first, second])
    assert both.num_tokens == 17 and both.state is second.state
    assert torch.equal(both.groups[1][:, :, :, 10:], second.groups[1])
    assert both.tokens(0, 10).state is None and both.tokens(10, 17).state is second.state
    assert both.nbytes == sum(t.numel() * t.element_size() for t in (*both.groups, *second.state.values()))
