"""The scheduler: which requests run (nano-vllm's `Scheduler`); it never touches the model. It
holds the requests waiting, prefilling and decoding, by their status, and chooses:
1. which waiting requests are admitted, while the batch has room (`max_batch` rows, and
   `max_batch_tokens` padded tokens: rows x the longest row's prompt + budget); the engine
   admits them (retrieval, stored KV) before the step's forwards;
2. which admitted request prefills, and how much: the oldest, whole when nothing else runs,
   else by one chunk of at most `prefill_chunk` tokens (a long prefill, such as --no-cache,
   never stalls the others for more than one chunk);
3. which requests leave: finished, cancelled or failed.
Every running request decodes by one token per step (the runner, ragkv.engine.runner). The
calls queued for the model's thread (retrieval, the catalog) run between steps.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass

from ragkv.core.config import BatchSettings
from ragkv.core.errors import RagkvError
from ragkv.engine.request import Request, Status


class Busy(RagkvError):
    """Too many turns wait for the model; retry shortly."""

    exit_code = 5


@dataclass(frozen=True)
class Prefill:
    """This step's prefill: `request`'s next `size` prompt ids (None: all that are left)."""

    request: Request
    size: int | None


class Scheduler:
    """The engine's requests. `add` and `call` may come from any thread; the rest from the one
    thread that steps (the engine's step lock)."""

    def __init__(self, settings: BatchSettings | None = None):
        self.settings = settings or BatchSettings()
        self.before_admit: Callable[[], None] | None = None  # e.g. move to a newer store generation
        self._queued = threading.Lock()  # guards the two queues callers append to
        self._waiting: deque[Request] = deque()
        self._calls: deque[tuple[Callable, tuple, Future]] = deque()  # other model work, between steps
        self._active: list[Request] = []  # admitted: prefilling or running, oldest first

    def _with(self, status: Status) -> list[Request]:
        return [r for r in self._active if r.status is status]

    @property
    def num_running(self) -> int:
        return len(self._active)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._calls or self._active)

    def add(self, request: Request) -> None:
        """Queue `request`. Raises Busy when `max_queue` requests wait."""
        with self._queued:
            self._check_room()
            self._waiting.append(request)

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

    def run_calls(self) -> None:
        while self._calls:
            with self._queued:
                fn, args, future = self._calls.popleft()
            try:
                future.set_result(fn(*args))
            except BaseException as exc:
                future.set_exception(exc)

    def admissible(self) -> Iterator[Request]:
        """The waiting requests the batch has room for, oldest first, each taken off the queue as
        it is given; the caller admits it (`Request.admit`) and, if that succeeded, hands it back
        (`admitted`) before the next is weighed."""
        if self._waiting and self.before_admit is not None:
            self.before_admit()
        while self._waiting and self._has_room():
            with self._queued:
                request = self._waiting.popleft()
            yield request

    def admitted(self, request: Request) -> None:
        self._active.append(request)

    def _has_room(self) -> bool:
        if not self._active:
            return True  # one request always runs, however large
        if len(self._active) >= self.settings.max_batch:
            return False
        # The next request's size is known only once admitted; count its worst case as the longest now.
        longest = max(r.reserved_tokens for r in self._active)
        return (len(self._active) + 1) * longest <= self.settings.max_batch_tokens

    def schedule(self) -> Prefill | None:
        """This step's prefill, if any request is prefilling (see the module's docstring)."""
        prefilling = self._with(Status.PREFILLING)
        if not prefilling:
            return None
        others = len(self._active) > 1 or self._waiting
        return Prefill(prefilling[0], self.settings.prefill_chunk if others else None)

    def running(self, request: Request) -> None:
        """`request`'s prompt is in: it decodes from now on."""
        request.status = Status.RUNNING

    def cancelled(self) -> list[Request]:
        """The admitted requests their callers cancelled, taken out."""
        gone = [r for r in self._active if r.is_cancelled]
        self._active = [r for r in self._active if not r.is_cancelled]
        return gone

    def leave(self, request: Request) -> None:
        """`request` is finished or failed."""
        self._active.remove(request)

    def fail_all(self, exc: BaseException) -> None:
        """A step failed where no one request can be blamed: every admitted request fails."""
        for request in self._active:
            if not request.future.done():
                request.fail(exc)
        self._active = []
