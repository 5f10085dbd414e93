"""Continuous batching: one model thread advances every active answer by one token per
forward pass, whatever its context (stored document KV, a conversation, a full prefill).

    batcher = engine.batched()                      # engine: a QueryEngine (ragkv.open)
    answer = batcher.ask("How do I rotate the API key?")        # from any number of threads
    ticket = batcher.submit(conversation, message, on_text=print)  # streaming, cancellable

Each loop iteration of the model thread:
1. admits waiting turns while the batch has room (`max_batch` rows, and `max_batch_tokens`
   padded tokens: rows x the longest row's prompt + budget): retrieval and the stored KV are
   loaded into the turn's own cache;
2. prefills the oldest admitted turn by one chunk of at most `prefill_chunk` tokens (a long
   prefill, such as --no-cache, never stalls the others for more than one chunk);
3. advances every decoding row by one token in one forward (`kv.RaggedBatch`: each row's
   tokens in a slot of its own, a padding mask, per-row positions).
A turn whose prefill is done picks its first token and joins the batch; a finished or
cancelled one leaves it at once (its KV goes back to its conversation, for a follow-up).
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

from ragkv import kv
from ragkv.answer import Answer
from ragkv.config import AskSettings, DecodeSettings
from ragkv.conversation import Conversation, TurnPlan
from ragkv.errors import InputError, RagkvError
from ragkv.generate import DecodeState, prefill
from ragkv.runtime import Runtime
from ragkv.text import check_text

log = logging.getLogger("ragkv")


class Busy(RagkvError):
    """Too many turns wait for the model; retry shortly."""

    exit_code = 5


@dataclass(frozen=True)
class BatchSettings:
    max_batch: int = 16  # rows decoded together
    max_batch_tokens: int = 32768  # rows x the longest row's (prompt + budget): KV the batch may hold, padded
    prefill_chunk: int = 256  # most prompt tokens one turn prefills per loop iteration
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
    conversation: Conversation | Callable[[], Conversation]  # a factory runs on the model thread
    message: str
    max_new_tokens: int
    decoding: DecodeSettings
    on_text: Callable[[str], None] | None
    plan: TurnPlan | None = None
    pending: list[int] = field(default_factory=list)  # prompt ids still to prefill
    state: DecodeState | None = None
    max_rows: int = 1  # the largest batch this turn decoded in

    @property
    def reserved_tokens(self) -> int:
        """Tokens this turn's row may come to hold: prompt + budget."""
        return len(self.plan.prompt_ids) + self.plan.budget if self.plan else 0


class Batcher:
    """Runs every turn submitted to it on one model thread, decoding them together. Owns the
    runtime's model while open: do not call the engine's own ask/stream meanwhile."""

    def __init__(
        self, runtime: Runtime, settings: BatchSettings | None = None, before_admit: Callable[[], None] | None = None
    ):
        self.runtime = runtime
        self.settings = settings or BatchSettings()
        self.before_admit = before_admit  # e.g. move the engine to a newer store generation
        self._waiting: deque[_Turn] = deque()
        self._prefilling: deque[_Turn] = deque()
        self._rows: list[_Turn] = []  # decoding, in RaggedBatch row order
        self._batch = kv.RaggedBatch(runtime.lm.model.config)
        self._calls: deque[tuple[Callable, tuple, Future]] = deque()  # other model-thread work, between steps
        self._wake = threading.Condition()
        self._closed = False
        self.tokens_generated = 0  # since open
        self._rate: deque[tuple[float, int]] = deque()  # (when, tokens_generated) over the last 10 s
        self._thread = threading.Thread(target=self._loop, name="ragkv-batcher", daemon=True)
        self._thread.start()

    # -- the callers' side (any thread) ---------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self._rows) + len(self._prefilling)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def tokens_per_s(self) -> float:
        """Answer tokens generated per second over the last 10 s."""
        rate = list(self._rate)
        if len(rate) < 2 or rate[-1][0] == rate[0][0]:
            return 0.0
        return (rate[-1][1] - rate[0][1]) / (rate[-1][0] - rate[0][0])

    def submit(
        self,
        conversation: Conversation | Callable[[], Conversation],
        message: str,
        max_new_tokens: int,
        decoding: DecodeSettings,
        on_text: Callable[[str], None] | None = None,
    ) -> Ticket:
        """Queue the next turn of `conversation` (or of the one a factory returns, called on the
        model thread when the turn is admitted: opening one may retrieve and load KV).
        `on_text(delta)` is called on the model thread as text is generated. Raises Busy when
        `max_queue` turns already wait."""
        if not check_text(message, "the message").strip():
            raise InputError("the message is empty; say something")
        if isinstance(conversation, Conversation):
            conversation.settings.check_batchable("batched decoding")
        turn = _Turn(Ticket(), conversation, message, max_new_tokens, decoding, on_text)
        with self._wake:
            if self._closed:
                raise RagkvError("the batcher is closed")
            if len(self._waiting) + len(self._calls) >= self.settings.max_queue:
                raise Busy(f"{len(self._waiting)} requests wait for the model; retry shortly")
            self._waiting.append(turn)
            self._wake.notify()
        return turn.ticket

    def ask(self, question: str, settings: AskSettings | None = None, **options) -> Answer:
        """Answer `question` (options as in `AskSettings`), batched with whatever else runs."""
        settings = settings or AskSettings.from_dict(options)
        settings.check_batchable("batched decoding")
        return self.submit(
            lambda: Conversation(self.runtime, settings), question, settings.max_new_tokens, settings.decoding
        ).result()

    def call(self, fn: Callable, *args) -> Future:
        """Run `fn(*args)` on the model thread between two steps (work that shares the engine:
        retrieval, the catalog). Counts against `max_queue`."""
        future: Future = Future()
        with self._wake:
            if len(self._waiting) + len(self._calls) >= self.settings.max_queue:
                raise Busy("too many requests wait for the model; retry shortly")
            self._calls.append((fn, args, future))
            self._wake.notify()
        return future

    def close(self) -> None:
        """Finish what is admitted or waiting, then stop the model thread."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- the model thread -----------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._wake:
                while not (self._waiting or self._calls or self._prefilling or self._rows or self._closed):
                    self._wake.wait()
                if self._closed and not (self._waiting or self._calls or self._prefilling or self._rows):
                    return
            self._run_calls()
            try:
                self._drop_cancelled()
                self._admit()
                if self._prefilling:
                    self._prefill_step(self._prefilling[0])
                if self._rows:
                    self._decode_step()
            except BaseException as exc:  # a bug or a device error: fail what is active, keep serving
                log.exception("batch step failed")
                self._fail_active(exc)

    def _run_calls(self) -> None:
        while self._calls:
            with self._wake:
                fn, args, future = self._calls.popleft()
            try:
                future.set_result(fn(*args))
            except BaseException as exc:
                future.set_exception(exc)

    def _admit(self) -> None:
        if self._waiting and self.before_admit is not None:
            self.before_admit()
        while self._waiting and self._has_room():
            with self._wake:
                turn = self._waiting.popleft()
            if turn.ticket.is_cancelled:
                turn.ticket.resolve(error=InputError("cancelled before it started"))
                continue
            try:  # whatever fails as a turn joins fails that turn alone: the batch goes on
                if not isinstance(turn.conversation, Conversation):
                    turn.conversation = turn.conversation()
                turn.plan = turn.conversation.begin_turn(turn.message, turn.max_new_tokens)
                turn.pending = list(turn.plan.live_ids)
                turn.state = DecodeState(
                    self.runtime.lm.tokenizer,
                    self.runtime.lm.facts.eos_ids,
                    turn.plan.budget,
                    turn.decoding,
                    turn.plan.start,
                )
            except Exception as exc:
                if not isinstance(exc, RagkvError):
                    log.exception("a request failed as it joined the batch")
                turn.ticket.resolve(error=exc)
                continue
            self._prefilling.append(turn)

    def _has_room(self) -> bool:
        active = [*self._rows, *self._prefilling]
        if not active:
            return True  # one turn always runs, however large
        if len(active) >= self.settings.max_batch:
            return False
        # The next turn's size is known only once admitted; count its worst case as the longest now.
        longest = max(t.reserved_tokens for t in active)
        return (len(active) + 1) * longest <= self.settings.max_batch_tokens

    def _prefill_step(self, turn: _Turn) -> None:
        """Prefill `turn` by one chunk; once its prompt is in, pick its first token and add its row.
        A failure before the row joins the batch touches only this turn's own cache: it fails alone."""
        try:
            started = time.perf_counter()
            chunk, turn.pending = (
                turn.pending[: self.settings.prefill_chunk],
                turn.pending[self.settings.prefill_chunk :],
            )
            logits = prefill(self.runtime.lm.model, chunk, turn.plan.cache)
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
        try:
            self._batch.add(turn.plan.cache)
        except BaseException as exc:  # the shared batch may be half-changed: fail it here and reset all
            turn.ticket.resolve(error=exc)
            raise
        self._rows.append(turn)

    @torch.inference_mode()
    def _decode_step(self) -> None:
        logits = self._batch.step(self.runtime.lm.model, [t.state.next_token for t in self._rows])  # (B, V)
        for turn in self._rows:
            turn.max_rows = max(turn.max_rows, len(self._rows))
        done = [i for i, turn in enumerate(self._rows) if self._take(turn, logits[i])]
        self._leave(done)
        now = time.monotonic()
        self._rate.append((now, self.tokens_generated))
        while self._rate and now - self._rate[0][0] > 10.0:
            self._rate.popleft()

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
        cancelled = [i for i, t in enumerate(self._rows) if t.ticket.is_cancelled]
        for i in cancelled:
            self._rows[i].state.finish_reason = "cancelled"
        self._leave(cancelled)

    def _fail_active(self, exc: BaseException) -> None:
        for turn in [*self._prefilling, *self._rows]:
            if not turn.ticket.future.done():
                turn.ticket.resolve(error=exc)
        self._prefilling.clear()
        self._rows = []
        self._batch = kv.RaggedBatch(self.runtime.lm.model.config)
