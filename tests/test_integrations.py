"""The engine-neutral half of the vLLM connector: which leading prompt tokens a store holds,
and their KV, matched by ragkv's key chain and verified against the stored token ids. (The
connector itself runs inside vLLM: tests/test_vllm.py.)"""

from __future__ import annotations

import pytest
import torch

import ragkv
from ragkv.errors import ModelError
from ragkv.integrations.store_match import ModelIdentity, StoreMatcher, load_kv, profile_for, slot_mapping
from store import open_snapshot
from tests.conftest import QUESTIONS, build_store


@pytest.fixture(scope="module")
def identity(tiny_llama):
    return ModelIdentity.of_folder(tiny_llama, "float32")


def test_the_profile_is_found_for_the_same_model_and_refused_for_another(tiny_store, tiny_llama, identity):
    with ragkv.open(tiny_store, device="cpu") as engine:
        assert profile_for(tiny_store, identity) == engine.active.profile
    with pytest.raises(ModelError, match="holds no KV for this model in bfloat16") as err:
        profile_for(tiny_store, ModelIdentity.of_folder(tiny_llama, "bfloat16"))
    assert "\n" not in str(err.value)


def test_a_ragkv_prompt_matches_its_prefix_and_chunk_with_their_kv(tiny_store, identity):
    profile = profile_for(tiny_store, identity)
    matcher = StoreMatcher(tiny_store, profile)
    with ragkv.open(tiny_store, device="cpu") as engine:
        answer = engine.ask(QUESTIONS[0], max_new_tokens=1, context="chunk")
        (row, _), = engine.retrieve(QUESTIONS[0])
        prompt = answer.prompt_ids
        match = matcher.match(prompt)
        assert match.num_tokens == len(profile.prefix_ids) + len(row.token_ids)
        assert [e.kv_key for e in match.entries] == [matcher.prefix_entry.kv_key, row.entry.kv_key]
        stored = load_kv(engine.snapshot.shards, match.entries, torch.float32)
        assert stored.shape[3] == match.num_tokens
        expected = torch.cat([engine._load_prefix(), engine._chunk_kv(row.entry, answer.stats, 0)], dim=3)
        assert torch.equal(stored, expected)
    changed = list(prompt)
    changed[len(profile.prefix_ids) + 3] += 1  # one token of the chunk differs: only the prefix matches
    assert matcher.match(changed).num_tokens == len(profile.prefix_ids)
    assert matcher.match(prompt[1:]) is None  # no system prefix: nothing
    matcher.close()


def test_a_span_matches_through_its_continuations(tiny_llama, corpus, tmp_path, identity):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "long.md").write_text(" ".join(f"Paragraph {i} explains the deploy step number {i} in detail."
                                           for i in range(40)))
    build_store(docs, tmp_path / "s", str(tiny_llama), chunk_tokens=64, span_tokens=400)
    profile = profile_for(tmp_path / "s", identity)
    with ragkv.open(tmp_path / "s", device="cpu") as engine:
        answer = engine.ask("What is deploy step number 3?", max_new_tokens=1, context="document")
        separator = engine.active.layout.separator_ids
        num_context = len(answer.prompt_ids) - len(engine.active.layout.question_ids(engine.lm.tokenizer,
                                                                                       "What is deploy step number 3?"))
    match = StoreMatcher(tmp_path / "s", profile, separator).match(answer.prompt_ids)
    assert len(match.entries) > 2 and match.num_tokens == num_context


def test_slots_follow_the_request_blocks():
    assert slot_mapping([7, 2, 9], 4, 2, 10).tolist() == [30, 31, 8, 9, 10, 11, 36, 37]


def test_the_matcher_sees_a_newer_generation(tiny_llama, corpus, tmp_path, identity):
    build_store(corpus, tmp_path / "s", str(tiny_llama), precompute=0)
    profile = profile_for(tmp_path / "s", identity)
    matcher = StoreMatcher(tmp_path / "s", profile)
    with ragkv.open(tmp_path / "s", device="cpu", write_back=False) as engine:
        prompt = engine.ask(QUESTIONS[1], max_new_tokens=1).prompt_ids
    assert matcher.match(prompt).num_tokens == len(profile.prefix_ids)  # no chunk KV yet
    with ragkv.open(tmp_path / "s", device="cpu") as engine:
        engine.ask(QUESTIONS[1], max_new_tokens=1)
        engine.flush()  # the miss is written back
    assert matcher.match(prompt).num_tokens > len(profile.prefix_ids)
    with open_snapshot(tmp_path / "s") as snapshot:
        assert matcher.snapshot.generation == snapshot.generation
    matcher.close()
