"""The one engine every question goes through: `ask`, `stream`, conversations, `ragkv batch`,
`ragkv serve` and the framework adapters all add requests to one `Scheduler` and wait for
them, so whatever runs at the same time decodes together.

Who runs the steps:
- nobody asked for a thread (the Python API, `ragkv ask`): a caller waiting for its answer
  steps the scheduler in its own thread, while no other caller does (a lock). Alone, that is
  the plain prefill-then-decode loop; several threads asking at once take turns stepping and
  share each step's forward.
- `start()` (`engine.batched()`, `ragkv serve`): a background thread steps while there is work, and
  callers only wait. `stop()` finishes what is queued, then ends the thread.
A stream left before its end cancels its request; the request's row leaves at the next step
(its conversation keeps the turn, cut short).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import Future

from ragkv.core.config import AskSettings, BatchSettings, DecodeSettings
from ragkv.core.cpu import release_idle_threads
from ragkv.core.errors import InputError
from ragkv.core.text import check_text
from ragkv.engine.answer import Answer, AnswerStream
from ragkv.engine.conversation import Conversation
from ragkv.engine.request import Request
from ragkv.engine.runner import Runner
from ragkv.engine.runtime import Runtime
from ragkv.engine.scheduler import Scheduler

RATE_WINDOW_S = 10.0  # tokens_per_s looks this far back

log = logging.getLogger("ragkv")


class Engine:
    """One runtime's requests, stepped by whoever waits for them (see the module docstring)."""

    def __init__(self, runtime: Runtime, settings: BatchSettings | None = None):
        self.runtime = runtime
        self.scheduler = Scheduler(settings)
        self.runner = Runner(runtime.lm)
        self._step_lock = threading.Lock()  # one step at a time, in whichever thread
        self._stepper: int | None = None  # the thread inside a step
        self._progress = threading.Condition()  # notified after every step and when the lock frees
        self._thread: threading.Thread | None = None
        self._users = 0  # start() calls not yet stopped
        self._stopping = False
        self._rate: deque[tuple[float, int]] = deque()  # (when, tokens generated) over the window

    # -- requests --------------------------------------------------------------------------
    def submit(
        self,
        conversation: Conversation | Callable[[], Conversation],
        message: str,
        max_new_tokens: int,
        decoding: DecodeSettings,
        on_text: Callable[[str], None] | None = None,
    ) -> Request:
        """Queue the next turn of `conversation` (or of the one a factory returns once the turn is
        admitted: opening one may retrieve and load KV). `on_text(delta)` is called in the
        stepping thread as text is generated. Raises Busy when `max_queue` requests wait. Without
        a background thread, wait for it with `wait(request.future)`, which steps."""
        return self._queue(conversation, _checked(message), max_new_tokens, decoding, on_text)

    def submit_question(
        self,
        question: str,
        settings: AskSettings,
        history: Sequence[tuple[str, str]] = (),
        on_text: Callable[[str], None] | None = None,
        runtime: Runtime | None = None,
    ) -> Request:
        """Queue a new question (after the earlier (user, assistant) turns `history`): its
        conversation opens as it is admitted, over `runtime` (default: the engine's)."""
        opener = functools.partial(self.conversation, settings, history, runtime)
        return self.submit(opener, question, settings.max_new_tokens, settings.decoding, on_text)

    def conversation(
        self, settings: AskSettings, history: Sequence[tuple[str, str]] = (), runtime: Runtime | None = None
    ) -> Conversation:
        """A multi-turn conversation on this engine (the one place one is made): its first
        message retrieves, later ones reuse the cache. `history`: earlier (user, assistant) turns
        as a client remembers them, replayed (see `Conversation.replay`). `runtime`: the store's
        it answers from (another store's over the same loaded model joins this engine's batch:
        `QueryEngine(share=)`); default the engine's."""
        conversation = Conversation(runtime or self.runtime, settings, self)
        for user, assistant in history:
            conversation.replay(user, assistant)
        return conversation

    def _queue(self, conversation, message: str, max_new_tokens: int, decoding, on_text=None) -> Request:
        request = Request(conversation, message, max_new_tokens, decoding, on_text)
        self.scheduler.add(request)
        self._notify()
        return request

    def call(self, fn: Callable, *args):
        """`fn(*args)` run between two steps (work that must not overlap the model's: retrieval,
        the catalog); returns its result."""
        return self.wait(self.call_soon(fn, *args))

    def call_soon(self, fn: Callable, *args) -> Future:
        """`call`, without waiting: a future of its result."""
        future = self.scheduler.call(fn, *args)
        self._notify()
        return future

    def wait(self, future: Future):
        """The future's result, stepping the scheduler meanwhile where nobody else does."""
        self._advance(future.done)
        return future.result()

    def stream(
        self,
        conversation: Conversation | Callable[[], Conversation],
        message: str,
        max_new_tokens: int,
        decoding: DecodeSettings,
    ) -> AnswerStream:
        """The turn's answer as it is generated (iterate it; then `.result()`). The request is
        queued when iteration starts: a stream never iterated costs nothing."""
        return AnswerStream(self._follow(conversation, _checked(message), max_new_tokens, decoding))

    def ask_stream(
        self,
        question: str,
        settings: AskSettings,
        history: Sequence[tuple[str, str]] = (),
        runtime: Runtime | None = None,
    ) -> AnswerStream:
        """A new question (after `history`): retrieve, load the stored KV, prefill the rest, generate."""
        opener = functools.partial(self.conversation, settings, history, runtime)
        return self.stream(opener, question, settings.max_new_tokens, settings.decoding)

    def ask(self, question: str, settings: AskSettings, runtime: Runtime | None = None) -> Answer:
        return self.ask_stream(question, settings, (), runtime).drain()

    def _follow(
        self,
        conversation: Conversation | Callable[[], Conversation],
        message: str,
        max_new_tokens: int,
        decoding: DecodeSettings,
    ) -> Generator[str, None, Answer]:
        deltas: deque[str] = deque()  # appended in the stepping thread
        request = self._queue(conversation, message, max_new_tokens, decoding, deltas.append)
        try:
            while True:
                while deltas:
                    yield deltas.popleft()
                if request.future.done():
                    break
                self._advance(lambda: bool(deltas) or request.future.done())
        except GeneratorExit:  # the caller left the stream: free its row
            request.cancel()
            self._notify()
            if self._stepper != threading.get_ident():  # not closed from inside a step (by the collector)
                self._advance(request.future.done)
            raise
        return request.result()

    # -- who steps -------------------------------------------------------------------------
    def _advance(self, until: Callable[[], bool]) -> None:
        """Return once `until()` holds: step in this thread while no other thread steps."""
        while not until():
            if self._thread is None and self._step_lock.acquire(blocking=False):
                try:
                    while not until() and self._thread is None:
                        self._step()
                finally:
                    self._step_lock.release()
                    self._notify()
            else:
                with self._progress:
                    self._progress.wait_for(lambda: until() or (self._thread is None and not self._step_lock.locked()))

    def _step(self) -> None:
        """One step: the queued calls; the scheduler's choices (what leaves, what is admitted,
        what prefills), the admissions' work (retrieval, stored KV) before any forward; then the
        runner's forwards. Whatever fails fails the requests it touched; the engine stays usable."""
        scheduler, runner = self.scheduler, self.runner
        self._stepper = threading.get_ident()
        scheduler.run_calls()
        try:
            for request in scheduler.cancelled():
                request.finish(runner.release(request), "cancelled")
            for request in scheduler.admissible():
                if request.admit(self.runtime.lm):
                    scheduler.admitted(request)
            if (job := scheduler.schedule()) is not None:
                self._prefill(job.request, job.size)
            stepped = runner.decode()
            for request, exc in stepped.failed:
                scheduler.leave(request)
                request.fail(exc, "a request failed in its prefill")
            for request in stepped.entered:
                scheduler.running(request)
            for request, cache in stepped.finished:
                scheduler.leave(request)
                request.finish(cache)
        except BaseException as exc:  # a bug or a device error: fail what is active, keep serving
            log.exception("engine step failed")
            scheduler.fail_all(exc)
            runner.reset()
        finally:
            self._stepper = None
        now = time.monotonic()
        self._rate.append((now, runner.tokens_generated))
        while self._rate and now - self._rate[0][0] > RATE_WINDOW_S:
            self._rate.popleft()
        self._notify()

    def _prefill(self, request: Request, size: int | None) -> None:
        """`request`'s prefill (a failure fails it alone: only its own cache was touched), then
        its first token, and its row joins the running ones."""
        try:
            prompt_in, finished = self.runner.prefill(request, size)
        except Exception as exc:
            self.scheduler.leave(request)
            request.fail(exc, "a request failed in its prefill")
            return
        if finished:
            self.scheduler.leave(request)
            request.finish(request.cache)
        elif prompt_in:
            self.scheduler.running(request)
            self.runner.join(request)

    def _notify(self) -> None:
        with self._progress:
            self._progress.notify_all()

    def start(self, settings: BatchSettings | None = None, before_admit: Callable[[], None] | None = None) -> None:
        """Step in a background thread from now on, until as many `stop()` calls as starts.
        `settings` (the batch's bounds) and `before_admit` (e.g. move to a newer store
        generation before new turns join) apply from the next step."""
        with self._progress:
            if settings is not None:
                self.scheduler.settings = settings
            if before_admit is not None:
                self.scheduler.before_admit = before_admit
            self._users += 1
            if self._thread is None:
                self._stopping = False
                # This thread's OpenMP workers (if it ran parallel ops: an ask, a search), idle
                # while the new thread runs the forwards, would slow every forward there.
                release_idle_threads()
                self._thread = threading.Thread(target=self._loop, name="ragkv-engine", daemon=True)
                self._thread.start()
            self._progress.notify_all()

    def stop(self) -> None:
        """Undo one `start()`; the last finishes what is queued, then ends the thread."""
        with self._progress:
            self._users -= 1
            if self._users > 0 or self._thread is None:
                return
            self._stopping = True
            self._progress.notify_all()
            thread = self._thread
        thread.join()
        with self._progress:
            self._thread = None
            self.scheduler.before_admit = None
            self._progress.notify_all()

    def _loop(self) -> None:
        while True:
            with self._progress:
                self._progress.wait_for(lambda: self._stopping or self.scheduler.has_work)
                if self._stopping and not self.scheduler.has_work:
                    return
            with self._step_lock:
                self._step()

    # -- what it is doing ------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    def tokens_per_s(self) -> float:
        """Answer tokens generated per second over the last 10 s."""
        rate = list(self._rate)
        if len(rate) < 2 or rate[-1][0] == rate[0][0]:
            return 0.0
        return (rate[-1][1] - rate[0][1]) / (rate[-1][0] - rate[0][0])


def _checked(message: str) -> str:
    """The one check of a message every request makes, as it is made: text a tokenizer takes,
    and not empty."""
    if not check_text(message, "the message").strip():
        raise InputError("the message is empty; say something")
    return message
