"""The scheduler: what one step of the engine does (nano-vllm's `Scheduler`). It holds the
requests (turns of a conversation) waiting, prefilling and decoding; `step()` advances them,
in whichever thread the engine runs it (ragkv.engine):
1. runs the calls queued for the model's thread (retrieval, the catalog);
2. admits waiting turns while the batch has room (`max_batch` rows, and `max_batch_tokens`
   padded tokens: rows x the longest row's prompt + budget): retrieval and the stored KV are
   loaded into the turn's own cache;
3. prefills the oldest admitted turn: whole when nothing else runs, else by one chunk of at
   most `prefill_chunk` tokens (a long prefill, such as --no-cache, never stalls the others
   for more than one chunk);
4. advances every decoding row by one token: the rows together in one forward
   (`RaggedBatch`: each row's tokens in a slot of its own, a padding mask, per-row
   positions), and a turn that attends in its own way (`--mode ape`) in a forward of its own.
A turn whose prefill is done picks its first token and joins the batch; a finished or
cancelled one leaves it at once (its KV goes back to its conversation, for a follow-up). A
turn decoding alone steps its own cache (no copy into a batch and back: the plain loop); the
next turn to finish its prefill brings it into the batch.
Every token is chosen by the turn's own `Decoder`, so in float32 an answer from inside a
batch equals the same question asked alone (tested).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

import torch

from ragkv.core.config import DecodeSettings
from ragkv.core.errors import InputError, RagkvError
from ragkv.core.text import check_text
from ragkv.engine.answer import Answer
from ragkv.engine.conversation import Conversation, TurnPlan
from ragkv.engine.runtime import Runtime
from ragkv.kv.ragged import RaggedBatch
from ragkv.model.generate import DecodeState, prefill, start_decoding, step
from ragkv.modes.ape import attending

log = logging.getLogger("ragkv")


class Busy(RagkvError):
    """Too many turns wait for the model; retry shortly."""

    exit_code = 5


@dataclass(frozen=True)
class BatchSettings:
    max_batch: int = 16  # rows decoded together
    max_batch_tokens: int = 32768  # rows x the longest row's (prompt + budget): KV the batch may hold, padded
    prefill_chunk: int = 256  # most prompt tokens one turn prefills per step while others run
    max_queue: int = 64  # turns that may wait to be admitted; more: Busy

    def __post_init__(self):
        for name in ("max_batch", "max_batch_tokens", "prefill_chunk", "max_queue"):
            if getattr(self, name) < 1:
                raise InputError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")


@dataclass
class Ticket:
    """A submitted turn: `future` resolves to its `Answer` (or its error); `cancel()` frees its
    row at the next step (the answer then ends with finish_reason "cancelled")."""

    future: Future = field(default_factory=Future)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.cancelled.set()

    @property
    def is_cancelled(self) -> bool:
        return self.cancelled.is_set() or self.future.cancelled()

    def resolve(self, answer: Answer | None = None, error: BaseException | None = None) -> None:
        """Set the outcome, unless the caller cancelled the future meanwhile."""
        try:
            if error is not None:
                self.future.set_exception(error)
            else:
                self.future.set_result(answer)
        except InvalidStateError:
            pass

    def result(self) -> Answer:
        return self.future.result()


@dataclass
class _Turn:
    ticket: Ticket
    conversation: Conversation | Callable[[], Conversation]  # a factory runs when the turn is admitted
    message: str
    max_new_tokens: int
    decoding: DecodeSettings
    on_text: Callable[[str], None] | None
    plan: TurnPlan | None = None
    pending: list[int] = field(default_factory=list)  # prompt ids still to prefill
    state: DecodeState | None = None
    max_rows: int = 1  # the largest batch this turn decoded in
    started: bool = False  # its prefill has begun

    @property
    def reserved_tokens(self) -> int:
        """Tokens this turn's row may come to hold: prompt + budget."""
        return len(self.plan.prompt_ids) + self.plan.budget if self.plan else 0

    @property
    def attends_apart(self) -> bool:
        """Whether the turn attends in its own way (ape's scaling): it always decodes in a forward
        of its own (a plain turn does only while it is alone)."""
        return self.plan is not None and self.plan.attention is not None


class Scheduler:
    """The engine's requests and what one `step()` does with them. `add_request` and `call`
    may come from any thread; `step` from one thread at a time (the engine's step lock)."""

    def __init__(self, runtime: Runtime, settings: BatchSettings | None = None):
        self.runtime = runtime
        self.settings = settings or BatchSettings()
        self.before_admit: Callable[[], None] | None = None  # e.g. move to a newer store generation
        self._queued = threading.Lock()  # guards the two queues callers append to
        self._waiting: deque[_Turn] = deque()
        self._calls: deque[tuple[Callable, tuple, Future]] = deque()  # other model work, between steps
        self._prefilling: deque[_Turn] = deque()
        self._rows: list[_Turn] = []  # decoding together, in RaggedBatch row order
        self._solo: list[_Turn] = []  # decoding in forwards of their own: ape turns, and a plain turn alone
        self._rows_batch: RaggedBatch | None = None  # made with the first row: an engine without weights has none
        self.tokens_generated = 0  # since open

    @property
    def _batch(self) -> RaggedBatch:
        if self._rows_batch is None:
            self._rows_batch = RaggedBatch(self.runtime.lm.model.config)
        return self._rows_batch

    @property
    def num_running(self) -> int:
        return len(self._rows) + len(self._solo) + len(self._prefilling)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._calls or self.num_running)

    def add_request(
        self,
        conversation: Conversation | Callable[[], Conversation],
        message: str,
        max_new_tokens: int,
        decoding: DecodeSettings,
        on_text: Callable[[str], None] | None = None,
    ) -> Ticket:
        """Queue the next turn of `conversation` (or of the one a factory returns, called when
        the turn is admitted: opening one may retrieve and load KV). `on_text(delta)` is called
        in the stepping thread as text is generated. Raises Busy when `max_queue` turns wait."""
        if not check_text(message, "the message").strip():
            raise InputError("the message is empty; say something")
        turn = _Turn(Ticket(), conversation, message, max_new_tokens, decoding, on_text)
        with self._queued:
            self._check_room()
            self._waiting.append(turn)
        return turn.ticket

    def call(self, fn: Callable, *args) -> Future:
        """Run `fn(*args)` at the start of the next step (work that shares the model's thread:
        retrieval, the catalog). Counts against `max_queue`."""
        future: Future = Future()
        with self._queued:
            self._check_room()
            self._calls.append((fn, args, future))
        return future

    def _check_room(self) -> None:
        if len(self._waiting) + len(self._calls) >= self.settings.max_queue:
            raise Busy(f"{len(self._waiting) + len(self._calls)} requests wait for the model; retry shortly")

    def step(self) -> None:
        """Advance every request by one step (see the module's docstring). Whatever fails here
        fails the requests it touched; the scheduler stays usable."""
        self._run_calls()
        try:
            self._drop_cancelled()
            self._admit()
            if self._prefilling:
                self._prefill_step(self._prefilling[0])
            if self._rows or self._solo:
                self._decode_step()
        except BaseException as exc:  # a bug or a device error: fail what is active, keep serving
            log.exception("engine step failed")
            self._fail_active(exc)

    def _run_calls(self) -> None:
        while self._calls:
            with self._queued:
                fn, args, future = self._calls.popleft()
            try:
                future.set_result(fn(*args))
            except BaseException as exc:
                future.set_exception(exc)

    def _admit(self) -> None:
        if self._waiting and self.before_admit is not None:
            self.before_admit()
        while self._waiting and self._has_room():
            with self._queued:
                turn = self._waiting.popleft()
            if turn.ticket.is_cancelled:
                turn.ticket.resolve(error=InputError("cancelled before it started"))
                continue
            try:  # whatever fails as a turn joins fails that turn alone: the batch goes on
                if not isinstance(turn.conversation, Conversation):
                    turn.conversation = turn.conversation()
                turn.plan = turn.conversation.begin_turn(turn.message, turn.max_new_tokens)
                turn.pending = list(turn.plan.live_ids)
                turn.state = start_decoding(self.runtime.lm, turn.plan.budget, turn.decoding, turn.plan.start)
            except Exception as exc:
                if not isinstance(exc, RagkvError):
                    log.exception("a request failed as it joined the batch")
                turn.ticket.resolve(error=exc)
                continue
            self._prefilling.append(turn)

    def _has_room(self) -> bool:
        active = [*self._rows, *self._solo, *self._prefilling]
        if not active:
            return True  # one turn always runs, however large
        if len(active) >= self.settings.max_batch:
            return False
        # The next turn's size is known only once admitted; count its worst case as the longest now.
        longest = max(t.reserved_tokens for t in active)
        return (len(active) + 1) * longest <= self.settings.max_batch_tokens

    def _prefill_step(self, turn: _Turn) -> None:
        """Prefill `turn` (by one chunk while others run); once its prompt is in, pick its first
        token and add its row. A failure before the row joins the batch touches only this
        turn's own cache: it fails alone."""
        try:
            started = time.perf_counter()
            first = not turn.started
            if first:
                turn.started = True
                self._catch_up(turn)
            others = self._rows or self._solo or len(self._prefilling) > 1 or self._waiting
            size = self.settings.prefill_chunk if others else len(turn.pending)
            chunk, turn.pending = turn.pending[:size], turn.pending[size:]
            model = attending(self.runtime.lm.model, turn.plan.attention)
            logits = prefill(model, chunk, turn.plan.cache, turn.plan.recompute if first else None)
            turn.state.prefill_s += time.perf_counter() - started
            if turn.pending:
                return
            self._prefilling.popleft()
            if turn.plan.after_prefill is not None:
                turn.plan.after_prefill(turn.plan.cache)
            if self._take(turn, logits):
                self._finish(turn, turn.plan.cache)
                return
        except Exception as exc:
            if turn in self._prefilling:
                self._prefilling.remove(turn)
            if not isinstance(exc, RagkvError):
                log.exception("a request failed in its prefill")
            turn.ticket.resolve(error=exc)
            return
        alone = [t for t in self._solo if not t.attends_apart]  # a plain turn that had the model to itself
        if turn.attends_apart or not (self._rows or alone):
            self._solo.append(turn)
            return
        joining = [*alone, turn]
        try:
            for row in joining:
                self._batch.add(row.plan.cache)
                if row in self._solo:
                    self._solo.remove(row)
                self._rows.append(row)
        except BaseException as exc:  # the shared batch may be half-changed: fail them here and reset all
            for row in joining:
                if not row.ticket.future.done():
                    row.ticket.resolve(error=exc)
            raise

    @staticmethod
    def _catch_up(turn: _Turn) -> None:
        """As `turn`'s prefill starts: what a turn admitted with it over the same context has
        prefilled since (the prefix cache) joins its cache instead of being prefilled again."""
        assert turn.plan is not None  # admitted
        if turn.plan.catch_up is None or not (added := turn.plan.catch_up(turn.plan.cache)):
            return
        turn.pending = turn.pending[added:]
        stats = turn.plan.stats
        stats.reused_tokens += added
        stats.prefix_cache_tokens += added
        stats.computed_tokens -= added

    @torch.inference_mode()
    def _decode_step(self) -> None:
        size = len(self._rows) + len(self._solo)
        for turn in [*self._rows, *self._solo]:
            turn.max_rows = max(turn.max_rows, size)
        if self._rows:
            logits = self._batch.step(self.runtime.lm.model, [t.state.to_feed() for t in self._rows])  # (B, V)
            self._leave([i for i, turn in enumerate(self._rows) if self._take(turn, logits[i])])
        for turn in list(self._solo):
            model = attending(self.runtime.lm.model, turn.plan.attention)
            if self._take(turn, step(model, turn.state.to_feed(), turn.plan.cache)):  # logits (V,)
                self._solo.remove(turn)
                self._finish(turn, turn.plan.cache)

    def _take(self, turn: _Turn, logits: torch.Tensor) -> bool:
        """Pick `turn`'s next token from `logits`; returns whether the turn is finished."""
        had = len(turn.state.token_ids)
        finished = turn.state.take(logits)
        self.tokens_generated += len(turn.state.token_ids) - had
        if turn.state.delta and turn.on_text is not None:
            turn.on_text(turn.state.delta)
        return finished

    def _leave(self, rows: list[int]) -> None:
        for i in rows:
            self._finish(self._rows[i], self._batch.extract(i))
        if rows:
            self._rows = [self._rows[i] for i in self._batch.remove(rows)]

    def _finish(self, turn: _Turn, cache) -> None:
        if (tail := turn.state.finish()) and turn.on_text:
            turn.on_text(tail)
        try:
            answer = turn.conversation.end_turn(turn.plan, turn.state.result(), cache)
            answer.stats.batch_size = turn.max_rows
        except BaseException as exc:
            turn.ticket.resolve(error=exc)
            return
        turn.ticket.resolve(answer)

    def _drop_cancelled(self) -> None:
        for turn in [t for t in self._prefilling if t.ticket.is_cancelled]:
            self._prefilling.remove(turn)
            turn.state.finish_reason = "cancelled"
            self._finish(turn, None)
        for turn in [t for t in self._solo if t.ticket.is_cancelled]:
            self._solo.remove(turn)
            turn.state.finish_reason = "cancelled"
            self._finish(turn, turn.plan.cache)
        cancelled = [i for i, t in enumerate(self._rows) if t.ticket.is_cancelled]
        for i in cancelled:
            self._rows[i].state.finish_reason = "cancelled"
        self._leave(cancelled)

    def _fail_active(self, exc: BaseException) -> None:
        for turn in [*self._prefilling, *self._rows, *self._solo]:
            if not turn.ticket.future.done():
                turn.ticket.resolve(error=exc)
        self._prefilling.clear()
        self._rows, self._solo = [], []
        self._rows_batch = None
