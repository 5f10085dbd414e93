"""Multi-turn conversations: each turn reuses the cache of everything before it, and turn N's
answer equals a full prefill of the whole conversation so far (float32)."""

from __future__ import annotations

import pytest

import ragkv
from ragkv.core.errors import InputError
from ragkv.kv import cache as kv
from ragkv.model.generate import decode_alone
from tests.conftest import QUESTIONS


def full_prefill_answer(engine, ids, max_new_tokens):
    empty = kv.to_cache_empty(engine.lm.model.config)
    lm = engine.lm
    return decode_alone(lm, empty, ids, max_new_tokens).token_ids


@pytest.mark.parametrize("top_k", [1, 2])
def test_each_turn_prefills_only_what_is_new_and_equals_a_full_prefill(tiny_store, top_k):
    with ragkv.open(tiny_store, device="cpu") as engine:
        chat = engine.conversation(top_k=top_k, max_new_tokens=12)
        messages = [QUESTIONS[0], "And who stores the new key?", "Thanks. Anything else to check?"]
        previous_length = 0
        for number, message in enumerate(messages):
            answer = chat.ask(message)
            assert answer.prompt_ids == chat.ids()[: len(answer.prompt_ids)]
            if number:  # everything before this turn (a last token cut by max_new_tokens was never fed)
                assert answer.stats.reused_tokens == previous_length
                assert answer.stats.computed_tokens < 40  # the message and the template around it
            assert answer.token_ids == full_prefill_answer(engine, answer.prompt_ids, 12), number
            previous_length = len(answer.prompt_ids) + len(answer.token_ids) - (answer.stats.finish_reason == "length")
        assert [s.chunk_id for s in answer.sources] == [s.chunk_id for s in chat.sources]
        assert len(answer.sources) == top_k


def test_an_overflowing_conversation_drops_its_oldest_turns_and_stays_exact(tiny_store):
    with ragkv.open(tiny_store, device="cpu") as engine:
        chat = engine.conversation(max_new_tokens=8)
        long_message = "Please consider the following details carefully. " * 40  # ~360 tokens
        warned = None
        for _ in range(4):  # the tiny model's context is 1024 tokens
            answer = chat.ask(long_message)
            warned = warned or next((w for w in answer.stats.warnings if "dropped" in w), None)
            assert len(answer.prompt_ids) + 8 <= engine.lm.facts.max_context
            assert answer.token_ids == full_prefill_answer(engine, answer.prompt_ids, 8)
        assert warned and len(chat.turns) < 4
        with pytest.raises(InputError, match="empty"):
            chat.ask(" ")
        chat.reset()
        assert chat.turns == [] and chat.ask(QUESTIONS[1]).stats.reused_tokens > 0
