"""Ingest and query through the library: incremental runs, no stale KV, corruption fallback."""

from __future__ import annotations

import shutil

import pytest

import ragkv
from ragkv.core.errors import InputError, ModelError
from ragkv.store.generations import read_current
from tests.conftest import QUESTIONS, build_store, flip_bit_of_entry


def test_a_second_ingest_computes_nothing(tiny_llama, corpus, tmp_path):
    first = build_store(corpus, tmp_path / "s", str(tiny_llama))
    assert first.documents == {"added": 6, "changed": 0, "unchanged": 0, "removed": 0}
    assert first.kv_computed == first.chunks_embedded == 6 and first.tokens_computed > 0
    again = build_store(corpus, tmp_path / "s", str(tiny_llama))
    assert again.documents == {"added": 0, "changed": 0, "unchanged": 6, "removed": 0}
    assert again.kv_computed == again.chunks_embedded == again.tokens_computed == 0
    assert again.tokens_skipped == first.tokens_computed


def test_a_changed_document_is_recomputed_and_its_old_chunks_retired(tiny_llama, corpus, tmp_path):
    docs = tmp_path / "docs"
    shutil.copytree(corpus, docs)
    build_store(docs, tmp_path / "s", str(tiny_llama))
    (docs / "keys.md").write_text("API keys are rotated by the platform team on request.")
    report = build_store(docs, tmp_path / "s", str(tiny_llama))
    assert report.documents == {"added": 0, "changed": 1, "unchanged": 5, "removed": 0}
    assert report.kv_computed == 1 and report.chunks_embedded == 1
    with ragkv.open(tmp_path / "s", device="cpu") as engine:
        assert engine.snapshot.catalog.reports.counts()["chunks"] == 6 == len(engine.snapshot.vectors)
        ((row, _),) = engine.retrieve("Who rotates API keys?")
        assert row.text.startswith("API keys are rotated by the platform team")


def test_identical_chunks_share_one_kv_entry(tiny_llama, tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    for name in ("a.md", "b.md"):
        (docs / name).write_text("The same boilerplate paragraph appears in two documents.")
    report = build_store(docs, tmp_path / "s", str(tiny_llama))
    assert report.kv_computed == 1 and report.kv_reused == 1


def test_asking_with_another_model_is_a_clear_error_never_stale_kv(tiny_llama, tiny_qwen2, tiny_store, tmp_path):
    with pytest.raises(ModelError, match="has no KV for model"):
        ragkv.open(tiny_store, model=str(tiny_qwen2), device="cpu")
    with pytest.raises(ModelError, match="has no KV for model"):
        ragkv.open(tiny_store, dtype="bfloat16", device="cpu")
    # The same path with changed weights is another model.
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    store = tmp_path / "s"
    shutil.copytree(tiny_store, store)
    weights = model / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01
    weights.write_bytes(bytes(data))
    with pytest.raises(ModelError, match="has no KV for model"):
        ragkv.open(store, model=str(model), device="cpu")


def test_a_corrupt_entry_falls_back_to_a_full_prefill(tiny_store, tmp_path):
    store = tmp_path / "s"
    shutil.copytree(tiny_store, store)
    with ragkv.open(store, device="cpu") as engine:
        expected = engine.ask(QUESTIONS[0], max_new_tokens=8, use_cache=False)
        ((row, _),) = engine.retrieve(QUESTIONS[0])
    flip_bit_of_entry(store / "shards" / row.entry.shard, row.entry.tensor)
    with ragkv.open(store, device="cpu") as engine:
        answer = engine.ask(QUESTIONS[0], max_new_tokens=8)
    assert answer.stats.mode == "fallback" and answer.stats.reused_tokens == 0
    assert any("checksum" in w for w in answer.stats.warnings)
    assert answer.token_ids == expected.token_ids


def test_stream_yields_the_answer_text_piece_by_piece(tiny_store):
    with ragkv.open(tiny_store, device="cpu") as engine:
        stream = engine.stream(QUESTIONS[1], max_new_tokens=12)
        pieces = list(stream)
        assert stream.answer is not None and "".join(pieces) == stream.answer.text
        assert stream.answer.stats.ttft_s <= stream.answer.stats.total_s
        with pytest.raises(InputError, match="empty"):
            engine.ask("   ")
        with pytest.raises(InputError, match="unknown AskSettings"):
            engine.ask("hi", temprature=0.7)


def test_a_failed_ingest_leaves_the_store_untouched(tiny_store, tmp_path, corpus):
    store = tmp_path / "s"
    shutil.copytree(tiny_store, store)
    before = {p.name: p.stat().st_mtime_ns for p in store.rglob("*")}
    with pytest.raises(ModelError):
        build_store(corpus, store, str(tmp_path / "no-such-model"))
    with pytest.raises(InputError, match="does not fit"):
        build_store(corpus, store, "smollm2", chunk_tokens=100_000)
    assert {p.name: p.stat().st_mtime_ns for p in store.rglob("*")} == before
    assert read_current(store) == read_current(tiny_store)
