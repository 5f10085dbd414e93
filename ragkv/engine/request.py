"""One question from submission to answer (nano-vllm's `Sequence`): a turn of a conversation,
with its status, its prompt and cache (filled by its conversation as it is admitted), its
decoding state and the future its caller waits on. The scheduler moves its status, the runner
fills its decoding state, and the request finishes itself: its answer built once, by its
conversation, from what it holds."""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from ragkv.core.config import DecodeSettings
from ragkv.core.errors import InputError, RagkvError
from ragkv.engine.answer import Answer, Stats, timings
from ragkv.model.generate import DecodeState, Generated, start_decoding
from ragkv.model.llm import LoadedModel
from ragkv.modes.ape import Scaling
from ragkv.modes.blend import Recompute

log = logging.getLogger("ragkv")


class Status(enum.Enum):
    WAITING = "waiting"  # queued: not yet admitted
    PREFILLING = "prefilling"  # admitted: retrieval and stored KV done, its prompt going in
    RUNNING = "running"  # decoding, one token per step
    FINISHED = "finished"  # answered (or cancelled: the answer ends with finish_reason "cancelled")
    FAILED = "failed"  # its error is the future's


@runtime_checkable
class Talk(Protocol):
    """What a request is a turn of: a conversation (ragkv.engine.conversation.Conversation)."""

    def begin_turn(self, request: Request) -> None: ...

    def end_turn(self, request: Request, done: Generated, cache) -> Answer: ...


@dataclass(eq=False)
class Request:
    """A submitted turn. `result()` waits for its `Answer` (or raises its error); `cancel()` frees
    its row at the next step."""

    conversation: Talk | Callable[[], Talk]  # a factory runs when the request is admitted
    message: str
    max_new_tokens: int
    decoding: DecodeSettings
    on_text: Callable[[str], None] | None = None  # each piece of text as it is generated
    status: Status = Status.WAITING
    # -- the turn, as its conversation's `begin_turn` makes it at admission: prefill `pending`
    # on top of `cache`, then decode up to `budget` tokens
    cache: Any = None  # the conversation's cache (batch 1), holding prompt_ids[:what it holds]
    pending: list[int] = field(default_factory=list)  # prompt ids still to prefill
    prompt_ids: list[int] = field(default_factory=list)  # the whole conversation up to the answer
    budget: int = 0
    # what preparing the turn reported and counted, and what fitting it into the context said:
    # the answer's Stats are built from these once it is done (`stats_of`)
    reports: tuple = ()
    counts: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    start: float = 0.0  # the caller's clock when the turn began
    after_prefill: Callable[[object], None] | None = None  # (Assembly.after_prefill)
    attention: Scaling | None = None  # ape: how the turn's tokens attend to the context
    catch_up: Callable[[object], int] | None = None  # the first turn's (Assembly.catch_up)
    keep_question: Callable[[object], None] | None = None  # the first turn's (Assembly.keep_question)
    recompute: Recompute | None = None  # context tokens its first prefill recomputes (Assembly.recompute)
    # -- the decoding
    state: DecodeState | None = None
    started: bool = False  # its prefill has begun
    max_rows: int = 1  # the largest batch it decoded in
    caught_up: int = 0  # prompt tokens another request prefilled for it (the prefix cache), as it started
    future: Future = field(default_factory=Future)
    cancelled: threading.Event = field(default_factory=threading.Event)

    # -- the caller's side ----------------------------------------------------------------------
    def cancel(self) -> None:
        self.cancelled.set()

    @property
    def is_cancelled(self) -> bool:
        return self.cancelled.is_set() or self.future.cancelled()

    def result(self) -> Answer:
        return self.future.result()

    # -- what the scheduler and the runner read -------------------------------------------------
    @property
    def decode_state(self) -> DecodeState:
        """Its tokens so far and how the next is picked: set when it is admitted."""
        assert self.state is not None, "the request is not admitted yet"
        return self.state

    @property
    def reserved_tokens(self) -> int:
        """Tokens its row may come to hold: prompt + budget."""
        return len(self.prompt_ids) + self.budget

    @property
    def attends_apart(self) -> bool:
        """Whether it attends in its own way (ape's scaling): it always decodes in a forward of its
        own (a plain request does only while it is alone)."""
        return self.attention is not None

    # -- its life -------------------------------------------------------------------------------
    def admit(self, lm: LoadedModel) -> bool:
        """Build its prompt and cache: the conversation (a factory's runs now) retrieves, loads
        the stored KV and computes what the store lacks. Whatever fails fails this request alone;
        returns whether it is ready to prefill."""
        if self.is_cancelled:
            self.fail(InputError("cancelled before it started"))
            return False
        try:
            if not isinstance(self.conversation, Talk):
                self.conversation = self.conversation()
            self.conversation.begin_turn(self)
            self.state = start_decoding(lm, self.budget, self.decoding, self.start)
        except Exception as exc:
            self.fail(exc, "a request failed as it joined the batch")
            return False
        self.status = Status.PREFILLING
        return True

    def finish(self, cache, reason: str | None = None) -> None:
        """Its answer, from the conversation that keeps `cache` (its KV, for a follow-up; None:
        cancelled before its prefill ended)."""
        assert self.state is not None and isinstance(self.conversation, Talk)
        if reason is not None:
            self.state.finish_reason = reason
        if (tail := self.state.finish()) and self.on_text:
            self.on_text(tail)
        try:
            answer = self.conversation.end_turn(self, self.state.result(), cache)
        except BaseException as exc:
            self.fail(exc)
            return
        self.status = Status.FINISHED
        self._resolve(answer=answer)

    def stats_of(self, done: Generated) -> Stats:
        """The answer's stats, built once from the finished request: what preparing its turn
        reported and counted, the batch it decoded in, the prompt tokens another request
        prefilled for it (`caught_up`: from the prefix cache, not prefilled), its warnings, and
        `done`'s timings."""
        counts = dict(self.counts)
        stats = Stats.of(counts.pop("mode"), *self.reports, **counts, **timings(done, self.start))
        stats.batch_size = self.max_rows
        stats.reused_tokens += self.caught_up
        stats.prefix_cache_tokens += self.caught_up
        stats.computed_tokens -= self.caught_up
        stats.warnings += self.warnings
        return stats

    def fail(self, error: BaseException, where: str = "") -> None:
        """Fail it with `error` (a bug, not a RagkvError, is logged with its traceback: `where`)."""
        if where and not isinstance(error, RagkvError):
            log.exception(where)
        self.status = Status.FAILED
        self._resolve(error=error)

    def _resolve(self, answer: Answer | None = None, error: BaseException | None = None) -> None:
        """Set the outcome, unless the caller cancelled the future meanwhile."""
        try:
            if error is not None:
                self.future.set_exception(error)
            else:
                self.future.set_result(answer)
        except InvalidStateError:
            pass
