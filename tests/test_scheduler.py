"""Continuous batching: every answer produced inside a running batch equals the same question
asked alone (float32), whatever its context, length, or when it joined; a conversation turn
too; cancelled turns leave at once; admission respects the token budget."""

from __future__ import annotations

import shutil
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

import ragkv
from ragkv.core.config import AskSettings, DecodeSettings
from ragkv.core.errors import InputError
from ragkv.engine.runner import Runner
from ragkv.engine.scheduler import Busy
from ragkv.kv.ragged import RaggedBatch
from tests.conftest import QUESTIONS, flip_bit_of_entry

MIXED = [  # different contexts, prompt lengths, answer lengths and paths
    ("How do I rotate the API key?", dict(max_new_tokens=24)),
    ("How many days of annual leave do I get?", dict(max_new_tokens=9)),
    ("When are salaries paid?", dict(max_new_tokens=30, top_k=2)),
    ("What happens during a production deploy?", dict(max_new_tokens=16, use_cache=False)),  # a full prefill
    ("Who approves leave requests in the HR portal?", dict(max_new_tokens=20, stop=["the"])),
    ("What is the guest wifi password?", dict(max_new_tokens=12, temperature=0.7, seed=5)),
]


def _settings(options) -> AskSettings:
    return AskSettings.from_dict(options)


def _alone(engine, question, options):
    return engine.ask(question, _settings(options))


@pytest.fixture()
def engine(tiny_store):
    with ragkv.open(tiny_store, device="cpu") as engine:
        yield engine


def test_answers_decoded_together_equal_answers_alone(engine):
    alone = [_alone(engine, q, o) for q, o in MIXED]
    with engine.batched(prefill_chunk=8) as batcher:  # small chunks: prefills interleave
        tickets = [
            batcher.engine.submit(
                lambda o=o: engine.conversation(_settings(o)), q, _settings(o).max_new_tokens, _settings(o).decoding
            )
            for q, o in MIXED
        ]
        batched = [t.result() for t in tickets]
    assert max(a.stats.batch_size for a in batched) >= 3  # they really decoded together
    for (question, _), one, many in zip(MIXED, alone, batched, strict=False):
        assert many.token_ids == one.token_ids, question
        assert many.text == one.text and many.stats.finish_reason == one.stats.finish_reason
        assert many.stats.mode == one.stats.mode  # (reused counts differ: the lone runs warmed the prefix cache)


def test_a_request_joining_mid_decode_changes_nobody(engine):
    long_q, short_q = QUESTIONS[0], QUESTIONS[2]
    long_alone = engine.ask(long_q, max_new_tokens=40, no_repeat_ngram=0, repetition_penalty=1.0)
    short_alone = engine.ask(short_q, max_new_tokens=10)
    started = threading.Event()
    pieces = []

    def on_text(text):
        pieces.append(text)
        if len(pieces) == 3:
            started.set()

    with engine.batched() as batcher:
        plain = DecodeSettings(repetition_penalty=1.0, no_repeat_ngram=0)
        first = batcher.engine.submit(lambda: engine.conversation(AskSettings()), long_q, 40, plain, on_text)
        started.wait()  # the first is decoding: the second joins the running batch
        second = batcher.engine.submit(lambda: engine.conversation(AskSettings()), short_q, 10, DecodeSettings())
        assert second.result().token_ids == short_alone.token_ids
        assert first.result().token_ids == long_alone.token_ids
        assert "".join(pieces) == first.result().text
    assert second.result().stats.batch_size == 2


def test_a_conversation_turn_in_the_batch_equals_one_alone(engine):
    lone = engine.conversation(max_new_tokens=10)
    expected = [lone.ask(QUESTIONS[1]).token_ids, lone.ask("And who approves it?").token_ids]
    with engine.batched() as batcher:
        chat = engine.conversation(max_new_tokens=10)
        other = batcher.engine.submit(lambda: engine.conversation(AskSettings()), QUESTIONS[3], 20, DecodeSettings())
        got = [batcher.engine.submit(chat, QUESTIONS[1], 10, DecodeSettings()).result().token_ids]
        follow = batcher.engine.submit(chat, "And who approves it?", 10, DecodeSettings()).result()
        got.append(follow.token_ids)
        other.result()
    assert got == expected
    assert follow.stats.computed_tokens < 30 and follow.stats.reused_tokens > 0  # only the new message prefilled


def test_a_cancelled_turn_leaves_at_once_and_the_others_finish(engine):
    expected = engine.ask(QUESTIONS[2], max_new_tokens=12).token_ids
    begun = threading.Event()
    with engine.batched() as batcher:
        doomed = batcher.engine.submit(
            lambda: engine.conversation(AskSettings()),
            QUESTIONS[0],
            200,
            DecodeSettings(),
            on_text=lambda _: begun.set(),
        )
        other = batcher.engine.submit(lambda: engine.conversation(AskSettings()), QUESTIONS[2], 12, DecodeSettings())
        begun.wait()
        doomed.cancel()
        assert doomed.result().stats.finish_reason == "cancelled"
        assert other.result().token_ids == expected
    assert batcher.engine.num_running == 0 and batcher.engine.num_waiting == 0


def test_admission_keeps_the_batch_within_its_token_budget(engine):
    alone = [engine.ask(q, max_new_tokens=8).token_ids for q in QUESTIONS]
    with engine.batched(max_batch_tokens=1) as batcher:  # room for one row at a time
        tickets = [
            batcher.engine.submit(lambda: engine.conversation(AskSettings()), q, 8, DecodeSettings()) for q in QUESTIONS
        ]
        answers = [t.result() for t in tickets]
    assert [a.token_ids for a in answers] == alone
    assert all(a.stats.batch_size == 1 for a in answers)


def test_a_full_queue_is_busy_and_bad_turns_fail_alone(engine):
    running, gate = threading.Event(), threading.Event()

    def block():
        running.set()
        gate.wait()

    expected = engine.ask(QUESTIONS[0], max_new_tokens=4).token_ids
    with engine.batched(max_queue=2) as batcher:
        try:
            blocker = batcher.engine.call_soon(block)  # holds the stepping thread: what comes next waits
            running.wait()
            good = batcher.engine.submit(lambda: engine.conversation(AskSettings()), QUESTIONS[0], 4, DecodeSettings())
            bad = batcher.engine.submit(
                lambda: engine.conversation(AskSettings(doc_ids=("no-such-doc",))), QUESTIONS[1], 4, DecodeSettings()
            )
            with pytest.raises(Busy):
                batcher.engine.submit(lambda: engine.conversation(AskSettings()), QUESTIONS[1], 4, DecodeSettings())
        finally:
            gate.set()  # a failed check must not leave the thread blocked (close would wait forever)
        blocker.result()
        with pytest.raises(InputError, match="no-such-doc"):
            bad.result()
        assert good.result().token_ids == expected


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "prefilled apart"])
def test_a_turn_that_fails_as_it_joins_the_batch_gets_the_error_and_the_batcher_goes_on(engine, monkeypatch, packed):
    expected = engine.ask(QUESTIONS[1], max_new_tokens=6).token_ids
    first_alone = engine.ask(QUESTIONS[0], max_new_tokens=24).token_ids
    add = RaggedBatch.add
    failures = iter([RuntimeError("no memory for the row")])

    def add_once_failing(self, single):
        error = next(failures, None)
        if error is not None:
            raise error
        return add(self, single)

    monkeypatch.setattr(RaggedBatch, "add", add_once_failing)
    if not packed:  # the second's prompt is prefilled in a forward of its own, then both join the batch
        monkeypatch.setattr(Runner, "packs", property(lambda self: False))
    gate = threading.Event()
    with engine.batched(prefill_chunk=100_000) as batcher:  # each prompt in one step: the second joins the first
        assert batcher.engine.runner.packs is packed  # the tiny Llama takes packed steps
        blocker = batcher.engine.call_soon(gate.wait)  # both turns are admitted in the same step
        first = batcher.engine.submit(lambda: engine.conversation(AskSettings()), QUESTIONS[0], 24, DecodeSettings())
        second = batcher.engine.submit(lambda: engine.conversation(AskSettings()), QUESTIONS[2], 24, DecodeSettings())
        gate.set()
        blocker.result()
        # The first decodes alone on its own cache; the second brings both into the batch, and the
        # add fails. Packed: the second's row was to join before its prompt went in, and nothing
        # else changed: it alone gets the error and the first decodes on. Prefilled apart: the
        # half-changed batch is reset, and both turns it touched get the error.
        with pytest.raises(RuntimeError, match="no memory"):
            second.result()  # resolved, not left waiting
        if packed:
            assert first.result().token_ids == first_alone
        else:
            with pytest.raises(RuntimeError, match="no memory"):
                first.result()
        assert batcher.ask(QUESTIONS[1], max_new_tokens=6).token_ids == expected


def _unstartable_decoding() -> DecodeSettings:
    """Sampling settings whose generator cannot be seeded (torch takes 64 bits): the edge refuses
    such a seed, so this stands in for anything that fails as a turn joins the batch."""
    decoding = DecodeSettings(temperature=0.5, seed=1)
    object.__setattr__(decoding, "seed", 10**40)
    return decoding


def test_a_turn_that_cannot_start_decoding_fails_alone_and_the_batch_goes_on(engine):
    expected = engine.ask(QUESTIONS[0], max_new_tokens=24).token_ids
    gate = threading.Event()
    with engine.batched() as batcher:
        blocker = batcher.engine.call_soon(gate.wait)  # both turns wait, then join in the same step
        good = batcher.engine.submit(lambda: engine.conversation(AskSettings()), QUESTIONS[0], 24, DecodeSettings())
        bad = batcher.engine.submit(
            lambda: engine.conversation(AskSettings()), QUESTIONS[1], 24, _unstartable_decoding()
        )
        gate.set()
        blocker.result()
        with pytest.raises((OverflowError, ValueError)):  # torch's words for a seed past 64 bits
            bad.result()  # resolved, not left waiting
        assert good.result().token_ids == expected
        assert batcher.ask(QUESTIONS[2], max_new_tokens=4).text
    # left the block: the model thread stopped (a turn left unresolved used to block shutdown)
    assert batcher.engine.num_running == 0 and batcher.engine.num_waiting == 0


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "prefilled apart"])
def test_a_prefill_that_fails_fails_its_turn_alone(engine, monkeypatch, packed):
    from ragkv.engine import runner

    long_alone = engine.ask(QUESTIONS[0], max_new_tokens=30).token_ids
    if packed:  # the second's prompt goes in with the first's decode step, which fails once
        real_step = RaggedBatch.step_packed
        failures = iter([RuntimeError("out of memory in this request's prefill")])

        def step_failing_with_a_prompt(self, model, feeds):
            if any(len(ids) > 1 for ids in feeds) and (error := next(failures, None)) is not None:
                raise error
            return real_step(self, model, feeds)

        monkeypatch.setattr(RaggedBatch, "step_packed", step_failing_with_a_prompt)
    else:
        monkeypatch.setattr(Runner, "packs", property(lambda self: False))
        real_prefill = runner.prefill
        calls = {"n": 0}

        def second_prefill_fails(model, ids, cache, recompute=None):
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("out of memory in this request's prefill")
            return real_prefill(model, ids, cache, recompute)

        monkeypatch.setattr(runner, "prefill", second_prefill_fails)
    started = threading.Event()
    with engine.batched() as batcher:
        plain = DecodeSettings()
        running = batcher.engine.submit(
            lambda: engine.conversation(AskSettings()), QUESTIONS[0], 30, plain, lambda _: started.set()
        )
        started.wait()  # decoding: the second's prompt joins it
        failing = batcher.engine.submit(lambda: engine.conversation(AskSettings()), QUESTIONS[1], 30, plain)
        with pytest.raises(RuntimeError, match="out of memory"):
            failing.result()
        assert running.result().token_ids == long_alone


def test_a_corrupt_entry_falls_back_inside_the_batch_and_the_others_are_unaffected(tiny_store, tmp_path):
    store = tmp_path / "s"
    shutil.copytree(tiny_store, store)
    with ragkv.open(store, device="cpu") as engine:
        ((row, _),) = engine.retrieve(QUESTIONS[0])
        full = engine.ask(QUESTIONS[0], max_new_tokens=10, use_cache=False).token_ids
        others = [engine.ask(q, max_new_tokens=10) for q in QUESTIONS[1:]]
    flip_bit_of_entry(store / "shards" / row.entry.shard, row.entry.tensor)
    with ragkv.open(store, device="cpu") as engine, engine.batched() as batcher:
        tickets = [
            batcher.engine.submit(lambda: engine.conversation(AskSettings()), q, 10, DecodeSettings())
            for q in QUESTIONS
        ]
        answers = [t.result() for t in tickets]
    assert answers[0].stats.mode == "fallback" and answers[0].token_ids == full
    assert [a.token_ids for a in answers[1:]] == [o.token_ids for o in others]
    assert all(a.stats.mode == "exact" for a in answers[1:])


def test_threads_asking_through_the_python_api_share_the_batch(engine):
    questions = QUESTIONS * 2
    alone = {q: engine.ask(q, max_new_tokens=12).token_ids for q in QUESTIONS}
    with engine.batched(max_batch=8) as batcher, ThreadPoolExecutor(len(questions)) as pool:
        answers = list(pool.map(lambda q: batcher.ask(q, max_new_tokens=12), questions))
    assert [a.token_ids for a in answers] == [alone[q] for q in questions]


@pytest.mark.slow  # the bundled model over the whole sample corpus
def test_the_bundled_model_batched_equals_alone(sample_store):
    questions = QUESTIONS + ["What is a SEV1 incident?", "How long are database backups kept?"]
    with ragkv.open(sample_store[0], device="cpu") as engine:
        alone = [engine.ask(q, max_new_tokens=24).token_ids for q in questions]
        with engine.batched(prefill_chunk=64) as batcher:
            answers = [batcher.ask(q, max_new_tokens=24) for q in questions[:1]]  # warm, alone
            tickets = [
                batcher.engine.submit(lambda: engine.conversation(AskSettings()), q, 24, DecodeSettings())
                for q in questions
            ]
            answers = [t.result() for t in tickets]
    assert [a.token_ids for a in answers] == alone
    assert max(a.stats.batch_size for a in answers) > 1


def test_questions_over_one_context_admitted_together_prefill_its_later_chunks_once(engine):
    """Three turns over the same top-3 context join in one step: the first prefills the chunks
    after the stored first one, the others take them from the prefix cache as their own prefill
    starts (before: each prefilled them), and every answer equals asking alone."""
    from ragkv.modes.prefix_cache import PrefixCache

    settings = _settings(dict(max_new_tokens=8, top_k=3))
    question = "How do I rotate the API key?"
    alone = engine.ask(question, settings)
    engine.prefix_cache = PrefixCache(512 << 20)  # nothing left from the lone answer
    tickets = [
        engine.engine.submit(lambda: engine.conversation(settings), question, 8, settings.decoding) for _ in range(3)
    ]
    first, *others = [engine.engine.wait(ticket.future) for ticket in tickets]
    assert max(a.stats.batch_size for a in (first, *others)) >= 2  # admitted, and decoded, together
    later = first.stats.computed_tokens - others[0].stats.computed_tokens  # the later chunks' tokens
    assert first.stats.prefix_cache_tokens == 0 and later > 0
    for answer in others:
        assert answer.stats.prefix_cache_tokens == later
        assert answer.stats.reused_tokens == first.stats.reused_tokens + later
    for answer in (first, *others):
        assert answer.token_ids == alone.token_ids


def test_each_batch_knob_has_one_default_for_the_api_the_service_and_its_command_line():
    from ragkv.cli.serve import serve_options
    from ragkv.core.config import BatchSettings
    from ragkv.serve.api import ServeSettings

    from_command_line = serve_options.build(**{name: option.default for name, _, option in serve_options.options})
    assert from_command_line == ServeSettings() and ServeSettings().batch == BatchSettings()
    with pytest.raises(InputError, match="--max-queue must be at least 1"):
        serve_options.build(**{name: option.default for name, _, option in serve_options.options} | {"max_queue": 0})
