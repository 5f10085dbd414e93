"""Decoding: repetition controls, stop strings and seeded sampling act the same on the cached
path, a full prefill and a batch, so exactness keeps its meaning."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer
from transformers.generation.logits_process import (
    LogitsProcessorList,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
)

import ragkv
from ragkv.core.config import AskSettings, DecodeSettings
from ragkv.core.errors import InputError
from ragkv.engine.batch import Question, answer_all
from ragkv.model.decoding import Decoder, held_back, stop_at
from ragkv.model.generate import TextStream
from tests.conftest import QUESTIONS

PLAIN = dict(repetition_penalty=1.0, no_repeat_ngram=0)  # the old behaviour: greedy, no controls


def _ngrams(ids, n):
    return [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]


@pytest.mark.parametrize(
    "bad",
    [dict(repetition_penalty=0.9), dict(no_repeat_ngram=-1), dict(temperature=-0.1), dict(top_p=0.0), dict(stop=("",))],
)
def test_bad_decoding_settings_are_named(bad):
    with pytest.raises(InputError, match=next(iter(bad)).replace("_", "-")):
        DecodeSettings(**bad)


def test_ask_takes_decoding_options_flat_and_rejects_unknown_ones():
    settings = AskSettings.from_dict({"top_k": 2, "temperature": 0.5, "seed": 3, "stop": "\n"})
    assert settings.decoding == DecodeSettings(temperature=0.5, seed=3, stop=("\n",))
    with pytest.raises(InputError, match="temprature"):
        AskSettings.from_dict({"temprature": 0.5})


def test_stop_helpers():
    assert stop_at("abc STOP def", ["STOP", "def"]) == 4 and stop_at("abc", ["x"]) is None
    assert held_back("answer ST", ["STOP"]) == 2 and held_back("answer", ["STOP"]) == 0


def test_the_decoder_never_repeats_an_ngram_of_its_own_and_ignores_the_prompt():
    decoder = Decoder(DecodeSettings(repetition_penalty=1.0, no_repeat_ngram=2))
    logits = torch.zeros(10)
    logits[3], logits[4] = 2.0, 1.0  # a model that always wants 3, then 4
    picked = [decoder.next_token(logits) for _ in range(8)]
    assert len(set(_ngrams(picked, 2))) == len(_ngrams(picked, 2))
    assert picked[0] == 3  # the prompt (never shown to the decoder) does not count


def _through_transformers(settings: DecodeSettings, ids: list[int], logits: torch.Tensor) -> torch.Tensor:
    """What transformers' own processors make of `logits` after `ids` (the reference)."""
    processors = LogitsProcessorList()
    if settings.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(settings.repetition_penalty))
    if settings.no_repeat_ngram:
        processors.append(NoRepeatNGramLogitsProcessor(settings.no_repeat_ngram))
    return processors(torch.tensor([ids], dtype=torch.long), logits[None].clone())[0]


@pytest.mark.parametrize(
    "controls",
    [{}, dict(repetition_penalty=1.3, no_repeat_ngram=3), dict(no_repeat_ngram=2, repetition_penalty=1.0), PLAIN],
)
def test_the_repetition_controls_and_the_greedy_pick_equal_transformers_processors_and_argmax(controls):
    settings = DecodeSettings(**controls)
    generator = torch.Generator().manual_seed(3)
    vocab = 97
    for trial in range(300):
        length = int(torch.randint(0, 40, (1,), generator=generator))
        ids = torch.randint(
            0, 6 if trial % 2 else vocab, (length,), generator=generator
        ).tolist()  # odd trials repeat a lot
        logits = torch.randn(vocab, generator=generator) * 4
        logits[torch.randint(0, vocab, (5,), generator=generator)] = logits.max()  # ties: the first one wins
        logits[ids[:3]] = -logits[ids[:3]].abs()  # some seen ids have negative scores
        decoder = Decoder(settings)
        decoder.token_ids = list(ids)
        kept = logits.clone()
        expected = _through_transformers(settings, ids, logits)
        assert torch.equal(decoder._controlled(logits), expected), (trial, ids)
        assert decoder.next_token(logits) == int(expected.argmax())
        assert torch.equal(logits, kept)  # the caller's logits are left as they were


def test_the_same_seed_samples_the_same_tokens():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    settings = DecodeSettings(temperature=1.0, top_p=0.9, seed=7)
    first = [Decoder(settings).next_token(logits) for _ in range(1)]
    a, b = Decoder(settings), Decoder(settings)
    assert [a.next_token(logits) for _ in range(20)] == [b.next_token(logits) for _ in range(20)]
    assert first[0] == Decoder(settings).next_token(logits)


def test_a_text_stream_never_shows_a_stop_string(tiny_llama):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    ids = tokenizer("Rotate the key. Then STOP here please", add_special_tokens=False).input_ids
    stream = TextStream(tokenizer, ("STOP",))
    shown = ""
    for token in ids:
        shown += stream.push(token)
        if stream.stopped:
            break
    shown += stream.finish()
    assert shown == stream.text == "Rotate the key. Then " and stream.stopped


@pytest.mark.parametrize(
    "options",
    [
        {},
        PLAIN,
        dict(no_repeat_ngram=3, repetition_penalty=1.3),
        dict(temperature=0.8, top_p=0.9, seed=11),
    ],
)
def test_cached_and_full_prefill_decode_alike(tiny_store, options):
    with ragkv.open(tiny_store, device="cpu") as engine:
        for question in QUESTIONS[:2]:
            cached = engine.ask(question, max_new_tokens=24, **options)
            full = engine.ask(question, max_new_tokens=24, use_cache=False, **options)
            assert cached.stats.mode == "exact" and full.stats.mode == "full"
            assert cached.token_ids == full.token_ids and cached.text == full.text


def test_no_repeat_ngrams_end_the_loop_a_random_model_falls_into(tiny_store):
    with ragkv.open(tiny_store, device="cpu") as engine:
        plain = engine.ask(QUESTIONS[0], max_new_tokens=48, **PLAIN)
        controlled = engine.ask(QUESTIONS[0], max_new_tokens=48, repetition_penalty=1.0, no_repeat_ngram=4)
    assert len(set(_ngrams(plain.token_ids, 4))) < len(_ngrams(plain.token_ids, 4))  # it loops without control
    assert len(set(_ngrams(controlled.token_ids, 4))) == len(_ngrams(controlled.token_ids, 4))


def test_a_stop_string_ends_the_answer_on_every_path(tiny_store):
    with ragkv.open(tiny_store, device="cpu") as engine:
        free = engine.ask(QUESTIONS[2], max_new_tokens=24)
        words = free.text.split()
        assert len(words) > 3, free.text
        stop = words[len(words) // 2]
        cut = free.text[: free.text.index(stop)]
        streamed = engine.stream(QUESTIONS[2], max_new_tokens=24, stop=[stop])
        assert "".join(streamed) == cut == streamed.answer.text
        assert streamed.answer.stats.finish_reason == "stop"
        settings = AskSettings(max_new_tokens=24, decoding=DecodeSettings(stop=(stop,)))
        (batched,) = [o.answer for o in answer_all(engine, [Question("a", QUESTIONS[2])] * 2, settings)][:1]
        assert batched.text == cut and batched.token_ids == streamed.answer.token_ids
