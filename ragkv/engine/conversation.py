"""Multi-turn conversations over one retrieved context. The first turn retrieves and loads the
chunk KV; every later turn keeps the cache of everything before it (system, context, earlier
questions and answers) and prefills only the new message and the template around it.

The conversation is defined by token ids, answers included as generated, so turn N's cached
answer equals a full prefill of the whole conversation so far (float32).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

from ragkv.core.config import AskSettings, DecodeSettings
from ragkv.core.errors import InputError, RagkvError
from ragkv.core.text import check_text
from ragkv.engine.answer import Answer, AnswerStream, Source
from ragkv.engine.request import Request
from ragkv.engine.runtime import Prepared, Runtime
from ragkv.kv import cache as kv
from ragkv.kv.entry import State
from ragkv.model.generate import Generated
from ragkv.model.prompt import encode_text
from ragkv.modes.ape import Scaling
from ragkv.modes.blend import Recompute


class Streams(Protocol):
    """What runs a conversation's turns: the engine (ragkv.engine.engine.Engine)."""

    def stream(
        self, conversation: Conversation, message: str, max_new_tokens: int, decoding: DecodeSettings
    ) -> AnswerStream: ...


@dataclass
class Turn:
    message: str
    ids: list[int]  # the ids this turn added before its answer (message and template)
    answer_ids: list[int]


class Conversation:
    """Use `engine.conversation()`; then `ask` (or `stream`) once per user message. Its turns
    run on the engine that opened it, batched with whatever else that engine answers."""

    def __init__(self, runtime: Runtime, settings: AskSettings, engine: Streams | None = None):
        self.runtime = runtime
        self.settings = settings
        self.engine = engine
        self.reset()

    def ids(self) -> list[int]:
        """The whole conversation so far, as the model sees it."""
        ids = list(self.context_ids)
        for turn in self.turns:
            ids += turn.ids + turn.answer_ids
        return ids

    def ask(self, message: str, max_new_tokens: int | None = None, decoding: DecodeSettings | None = None) -> Answer:
        return self.stream(message, max_new_tokens, decoding).drain()

    def stream(
        self, message: str, max_new_tokens: int | None = None, decoding: DecodeSettings | None = None
    ) -> AnswerStream:
        """This turn's answer as it is generated; `max_new_tokens` and `decoding` default to
        the conversation's settings."""
        if self.engine is None:
            raise RagkvError("this conversation has no engine to run on; open it with engine.conversation()")
        return self.engine.stream(
            self, message, max_new_tokens or self.settings.max_new_tokens, decoding or self.settings.decoding
        )

    def replay(self, message: str, answer: str) -> None:
        """Add an earlier turn as a client remembers it (its answer as text; nothing is
        generated). Its tokens are prefilled with the next message."""
        check_text(message, "a message")
        check_text(answer, "an answer")
        runtime = self.runtime
        if not self.turns:
            prepared = runtime.prepare(message, self.settings)
            self._open_context(prepared)
            new_ids = prepared.question_ids
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
        self.recompute: Recompute | None = None  # query: what the next prefill recomputes of the context
        self._stored_context: int = 0  # leading context tokens whose KV came from the store
        self._context_state: State | None = None  # recurrent layers' state after them (see `_fit`)

    def begin_turn(self, request: Request) -> None:
        """Add `request`'s message as the next turn and fill in what generating its answer takes:
        prefill its `pending` ids on top of its `cache` (this conversation's cache, which the
        engine grows), then decode up to its `budget` tokens. The first turn retrieves and
        assembles the context. Finish with `end_turn`. (The message was checked as it was
        submitted: Engine.submit.)"""
        request.start = time.perf_counter()
        runtime, message = self.runtime, request.message
        if not self.turns:  # the counts come from assembling the context
            prepared = self.runtime.prepare(message, self.settings)
            self._open_context(prepared)
            new_ids, live_ids = prepared.question_ids, prepared.live_ids
            request.reports, request.counts = prepared.reports, prepared.counts
            assembly = prepared.assembly
            request.after_prefill, request.catch_up = assembly.after_prefill, assembly.catch_up
            request.keep_question = assembly.keep_question
            self.turns.append(Turn(message, new_ids, []))
        else:
            new_ids = runtime.active.layout.turn_ids(runtime.lm.tokenizer, message)
            self._fit(len(new_ids) + request.max_new_tokens, request.warnings)
            self.turns.append(Turn(message, new_ids, []))
            cached = kv.num_cached(self.cache)
            live_ids = self.ids()[cached:]
            request.counts = runtime.turn_counts(self.settings, cached, len(live_ids))
        request.prompt_ids = self.ids()
        request.budget = runtime.fit_budget(len(request.prompt_ids), request.max_new_tokens, request.warnings)
        request.cache, request.pending = self.cache, list(live_ids)
        request.attention = self.attention
        request.recompute, self.recompute = self.recompute, None  # the first prefill after the context takes it

    def end_turn(self, request: Request, done: Generated, cache=None) -> Answer:
        """Record the turn's answer (`done`); `cache`, when given, replaces the conversation's
        cache (it must hold the conversation's KV so far, as `request.cache` would)."""
        if cache is not None:
            self.cache = cache
            if request.keep_question is not None:
                request.keep_question(cache)
        self.turns[-1].answer_ids = list(done.token_ids)
        stats = request.stats_of(done)
        self.runtime.savings.add(stats)
        return Answer(request.message, done.text, done.token_ids, self.sources, stats, request.prompt_ids)

    def _open_context(self, prepared: Prepared) -> None:
        """Take the first message's retrieved context and its assembled cache."""
        self.context_ids = prepared.prompt_ids[: len(prepared.prompt_ids) - len(prepared.question_ids)]
        self.sources = prepared.sources()
        self.cache = prepared.assembly.cache
        self.attention = prepared.assembly.attention
        self.recompute = prepared.assembly.recompute
        self._stored_context = prepared.assembly.num_cached
        if self.cache.kv_layout.has_state and self._stored_context:  # a state is not cut back: kept for `_fit`
            self._context_state = kv.state_of(self.cache)

    def _fit(self, needed: int, warnings: list[str]) -> None:
        """Drop the oldest turns until the conversation plus `needed` tokens fits the context,
        then rebuild the cache from the stored context and re-prefill the rest (said in `warnings`)."""
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
        kv.crop(self.cache, self._stored_context, self._context_state)
        warnings.append(
            f"dropped the {dropped} oldest turn(s) to fit the model's context; "
            "re-prefilled the rest of the conversation"
        )
