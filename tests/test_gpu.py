"""The CUDA path (skipped without a GPU): KV read into pinned host buffers, copied without
blocking, bfloat16 by default; the answer agrees with a full prefill on the GPU."""

from __future__ import annotations

import pytest
import torch

import ragkv
from tests.conftest import QUESTIONS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_cuda_ingest_and_ask_use_pinned_buffers_and_agree(tiny_llama, corpus, tmp_path):
    report = ragkv.ingest([corpus], tmp_path / "s", model=ragkv.ModelSettings(model=str(tiny_llama)))
    assert (report.device, report.dtype) == ("cuda", "bfloat16")
    with ragkv.open(tmp_path / "s") as engine:
        assert engine.device == "cuda"
        answer = engine.ask(QUESTIONS[0], max_new_tokens=8)
        assert answer.stats.reused_tokens > 0 and answer.stats.ram_misses == 1
        assert all(buffer.is_pinned() for buffer in engine.loader.reads._read_buffers)
        cached = engine.first_token_logits(QUESTIONS[1])
        full = engine.first_token_logits(QUESTIONS[1], use_cache=False)
        bound = 1.5 * 2.0**-8 * engine.lm.facts.num_layers**0.5  # bf16 noise, as in test_exactness
        assert (cached - full).abs().max().item() <= bound * full.abs().max().item()


def test_cuda_float32_is_exact(tiny_llama, corpus, tmp_path):
    ragkv.ingest([corpus], tmp_path / "s", model=ragkv.ModelSettings(model=str(tiny_llama), dtype="float32"))
    with ragkv.open(tmp_path / "s") as engine:
        for question in QUESTIONS:
            cached = engine.ask(question, max_new_tokens=12)
            full = engine.ask(question, max_new_tokens=12, use_cache=False)
            assert cached.token_ids == full.token_ids
