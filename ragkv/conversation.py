"""Multi-turn conversations over one retrieved context. The first turn retrieves and loads the
chunk KV; every later turn keeps the cache of everything before it (system, context, earlier
questions and answers) and prefills only the new message and the template around it.

The conversation is defined by token ids, answers included as generated, so turn N's cached
answer equals a full prefill of the whole conversation so far (float32).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

from ragkv import kv
from ragkv.answer import Answer, AnswerStream, Source, Stats
from ragkv.ape import Scaling, attending
from ragkv.config import AskSettings, DecodeSettings
from ragkv.errors import InputError
from ragkv.generate import Generated, generate
from ragkv.prompt import encode_text
from ragkv.runtime import Runtime
from ragkv.text import check_text


@dataclass
class TurnPlan:
    """One turn's generation: prefill `live_ids` on top of `cache`, decode up to `budget`."""

    message: str
    cache: Any  # the conversation's cache (batch 1), holding prompt_ids[:num_cached]
    live_ids: list[int]
    budget: int
    after_prefill: Callable[[object], None] | None
    stats: Stats
    start: float  # the caller's clock when the turn began
    prompt_ids: list[int]  # the whole conversation up to the answer


@dataclass
class Turn:
    message: str
    ids: list[int]  # the ids this turn added before its answer (message and template)
    answer_ids: list[int]


class Conversation:
    """Use `engine.conversation()`; then `ask` (or `stream`) once per user message."""

    def __init__(self, runtime: Runtime, settings: AskSettings):
        self.runtime = runtime
        self.settings = settings
        self.reset()

    def ids(self) -> list[int]:
        """The whole conversation so far, as the model sees it."""
        ids = list(self.context_ids)
        for turn in self.turns:
            ids += turn.ids + turn.answer_ids
        return ids

    def ask(self, message: str, max_new_tokens: int | None = None, decoding: DecodeSettings | None = None) -> Answer:
        stream = self.stream(message, max_new_tokens, decoding)
        for _ in stream:
            pass
        return stream.result()

    def stream(
        self, message: str, max_new_tokens: int | None = None, decoding: DecodeSettings | None = None
    ) -> AnswerStream:
        """This turn's answer as it is generated; `max_new_tokens` and `decoding` default to
        the conversation's settings."""
        if not message.strip():
            raise InputError("the message is empty; say something")
        return AnswerStream(
            self._turn(message, max_new_tokens or self.settings.max_new_tokens, decoding or self.settings.decoding)
        )

    def replay(self, message: str, answer: str) -> None:
        """Add an earlier turn as a client remembers it (its answer as text; nothing is
        generated). Its tokens are prefilled with the next message."""
        check_text(message, "a message")
        check_text(answer, "an answer")
        runtime = self.runtime
        if not self.turns:
            new_ids, _, _ = self._open_context(message)
        else:
            new_ids = runtime.active.layout.turn_ids(runtime.lm.tokenizer, message)
        self.turns.append(Turn(message, new_ids, encode_text(runtime.lm.tokenizer, answer)))

    def reset(self) -> None:
        """Forget everything: the next message retrieves again."""
        self.turns: list[Turn] = []
        self.context_ids: list[int] = []  # prefix + retrieved chunks
        self.sources: list[Source] = []
        self.cache: Any = None  # holds the KV of ids()[:cached length]
        self.attention: Scaling | None = None  # ape: how the turns attend to the context
        self._stored_context: int = 0  # leading context tokens whose KV came from the store

    def _turn(self, message: str, max_new_tokens: int, decoding: DecodeSettings) -> Generator[str, None, Answer]:
        plan = self.begin_turn(message, max_new_tokens)
        lm = self.runtime.lm
        done = yield from generate(
            attending(lm.model, self.attention),
            lm.tokenizer,
            plan.cache,
            plan.live_ids,
            lm.facts.eos_ids,
            plan.budget,
            plan.start,
            plan.after_prefill,
            decoding,
        )
        return self.end_turn(plan, done)

    def begin_turn(self, message: str, max_new_tokens: int) -> TurnPlan:
        """Add `message` as the next turn and say what generating its answer takes: prefill
        `live_ids` on top of `cache` (this conversation's cache, which the caller grows), then
        decode up to `budget` tokens. The first turn retrieves and assembles the context.
        Finish with `end_turn`."""
        check_text(message, "the message")
        start = time.perf_counter()
        runtime = self.runtime
        after_prefill = None
        if not self.turns:
            new_ids, after_prefill, stats = self._open_context(message)
        else:
            stats = runtime.new_stats(self.settings)
            new_ids = runtime.active.layout.turn_ids(runtime.lm.tokenizer, message)
            self._fit(len(new_ids) + max_new_tokens, stats)
        self.turns.append(Turn(message, new_ids, []))
        conversation = self.ids()
        cached = kv.num_cached(self.cache)
        live_ids = conversation[cached:]
        if len(self.turns) > 1:  # the first turn's counts come from assembling its context
            stats.reused_tokens = cached
        stats.computed_tokens = len(live_ids)
        budget = runtime.fit_budget(len(conversation), max_new_tokens, stats)
        return TurnPlan(message, self.cache, live_ids, budget, after_prefill, stats, start, conversation)

    def end_turn(self, plan: TurnPlan, done: Generated, cache=None) -> Answer:
        """Record the turn's answer (`done`); `cache`, when given, replaces the conversation's
        cache (it must hold the conversation's KV so far, as `plan.cache` would)."""
        if cache is not None:
            self.cache = cache
        self.turns[-1].answer_ids = list(done.token_ids)
        plan.stats.record(done, plan.start)
        self.runtime.savings.add(plan.stats)
        return Answer(plan.message, done.text, done.token_ids, self.sources, plan.stats, plan.prompt_ids)

    def _open_context(self, message: str) -> tuple[list[int], Callable[[object], None] | None, Stats]:
        """Retrieve for the first message and assemble the context's cache; returns the
        message's ids (the question template around it), the assembly's after-prefill hook
        and what retrieving and loading did."""
        prepared = self.runtime.prepare(message, self.settings)
        self.context_ids = prepared.prompt_ids[: len(prepared.prompt_ids) - len(prepared.question_ids)]
        self.sources = prepared.sources()
        self.cache = prepared.assembly.cache
        self.attention = prepared.assembly.attention
        self._stored_context = prepared.assembly.num_cached
        return prepared.question_ids, prepared.assembly.after_prefill, prepared.stats

    def _fit(self, needed: int, stats: Stats) -> None:
        """Drop the oldest turns until the conversation plus `needed` tokens fits the context,
        then rebuild the cache from the stored context and re-prefill the rest (said in stats)."""
        room = self.runtime.lm.facts.max_context
        dropped = 0
        while self.turns and len(self.ids()) + needed > room:
            self.turns.pop(0)
            dropped += 1
        if not dropped:
            return
        if self.turns:  # the oldest kept turn now follows the context: it opens with the question head
            first = self.turns[0]
            layout = self.runtime.active.layout
            question = first.ids[len(layout.turn_head_ids or ()) :]
            first.ids = [*layout.question_head_ids, *question]
        if len(self.ids()) + needed > room:
            raise InputError("the context and this message do not fit the model's context; start a new conversation")
        kv.crop(self.cache, self._stored_context)
        stats.warnings.append(
            f"dropped the {dropped} oldest turn(s) to fit the model's context; "
            "re-prefilled the rest of the conversation"
        )
