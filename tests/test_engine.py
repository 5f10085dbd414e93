"""The one engine: `ask`, `stream` and conversations queue on the same scheduler as the batcher,
so answers running at the same time decode together without a batcher, each equal to asking
alone (float32); a stream left early frees its row, one never iterated costs nothing."""

from __future__ import annotations

import threading

import pytest

import ragkv
from ragkv.kv import cache as kv
from ragkv.model.generate import decode_alone
from tests.conftest import QUESTIONS

LONG = dict(max_new_tokens=40, no_repeat_ngram=0, repetition_penalty=1.0)  # runs past a short answer


@pytest.fixture()
def engine(tiny_store):
    with ragkv.open(tiny_store, device="cpu") as engine:
        yield engine


def test_an_ask_while_a_stream_is_open_decodes_beside_it_and_both_equal_alone(engine):
    long_alone = engine.ask(QUESTIONS[0], **LONG)
    short_alone = engine.ask(QUESTIONS[2], max_new_tokens=8)
    assert len(long_alone.token_ids) > 8  # still going when the short one ends
    stream = engine.stream(QUESTIONS[0], **LONG)
    steps = iter(stream)
    first = next(steps)  # the long answer has begun, and waits for its reader
    short = engine.ask(QUESTIONS[2], max_new_tokens=8)  # this thread steps: the long row comes along
    rest = "".join(steps)
    assert short.token_ids == short_alone.token_ids
    assert short.stats.batch_size == 2  # the two rows shared forwards
    assert stream.result().token_ids == long_alone.token_ids and first + rest == long_alone.text
    assert engine.engine.num_running == engine.engine.num_waiting == 0


def test_threads_asking_at_once_without_a_batcher_each_get_their_answer_alone(engine):
    questions = QUESTIONS[:3]
    alone = [engine.ask(q, max_new_tokens=12).token_ids for q in questions]
    results: dict[int, list[int]] = {}
    barrier = threading.Barrier(len(questions))

    def ask(number: int) -> None:
        barrier.wait()  # all at once: whoever gets the lock steps for everyone
        results[number] = engine.ask(questions[number], max_new_tokens=12).token_ids

    threads = [threading.Thread(target=ask, args=(n,)) for n in range(len(questions))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [results[n] for n in range(len(questions))] == alone


def test_a_stream_left_early_frees_its_row_and_the_engine_goes_on(engine):
    expected = engine.ask(QUESTIONS[1], max_new_tokens=6).token_ids
    steps = iter(engine.stream(QUESTIONS[0], **LONG))
    next(steps)
    assert engine.engine.num_running == 1
    steps.close()  # the reader left: the turn is cancelled and driven to its end at once
    assert engine.engine.num_running == engine.engine.num_waiting == 0
    assert engine.ask(QUESTIONS[1], max_new_tokens=6).token_ids == expected


def test_a_stream_never_iterated_queues_nothing(engine):
    stream = engine.stream(QUESTIONS[0], max_new_tokens=4)
    assert engine.engine.num_waiting == engine.engine.num_running == 0
    assert not engine.engine.scheduler.has_work
    with pytest.raises(RuntimeError, match="not finished"):
        stream.result()
    assert engine.ask(QUESTIONS[0], max_new_tokens=4).text is not None


def test_a_conversation_goes_on_exactly_after_a_turn_left_early(engine):
    chat = engine.conversation(**{**LONG, "max_new_tokens": 12})
    steps = iter(chat.stream(QUESTIONS[0], max_new_tokens=40))
    next(steps)
    next(steps)
    steps.close()  # the first answer is cut short; the conversation keeps what was said
    assert 0 < len(chat.turns[0].answer_ids) < 40
    answer = chat.ask("And who stores the new key?")
    assert answer.prompt_ids == chat.ids()[: len(answer.prompt_ids)]
    lm = engine.lm
    full = decode_alone(
        lm,
        kv.to_cache_empty(lm.model.config),
        answer.prompt_ids,
        12,
        decoding=chat.settings.decoding,
    )
    assert answer.token_ids == full.token_ids  # the cut turn's cache holds exactly its ids


def test_hot_names_what_the_ram_tier_holds(engine):
    assert engine.hot()["chunks"] == [] and engine.hot()["entries"] == 0
    answer = engine.ask(QUESTIONS[1], top_k=2, max_new_tokens=2)
    read = {c for c, source in answer.stats.kv_sources.items() if source == "store"}
    hot = engine.hot()
    assert read and read <= {c["chunk_id"] for c in hot["chunks"]}
    assert {s.doc_id for s in answer.sources if s.chunk_id in read} <= set(hot["documents"])
    assert hot["entries"] == len(engine.ram) and hot["bytes"] == engine.ram.bytes and hot["computed"] == 0
    engine.ram = type(engine.ram)(engine.ram.max_bytes)  # emptied: nothing is named any more
    assert engine.hot()["chunks"] == []
