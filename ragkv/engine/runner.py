"""The model's side of a step (nano-vllm's `ModelRunner`): the forwards and the sampling. It
prefills the chunk of a request's prompt the scheduler chose and picks its first token, and
decodes every running request by one token: the rows together in one forward (`RaggedBatch`:
each row's tokens in a slot of its own, a padding mask, per-row positions), and a request that
attends in its own way (`--mode ape`) in a forward of its own. A request decoding alone steps
its own cache (no copy into a batch and back: the plain loop); the next one to finish its
prefill brings it into the batch. On a plain attention model (`ragkv.kv.packed.packable`) a
prompt that arrives while others decode joins the batch first and its chunk is fed in the
same forward as their tokens (the packed step: the weights are read once for both). Every
token is chosen by the request's own `Decoder`, so in float32 an answer from inside a batch
equals the same question asked alone (tested)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ragkv.engine.request import Request
from ragkv.kv import direct
from ragkv.kv.cache import num_cached
from ragkv.kv.packed import packable
from ragkv.kv.ragged import RaggedBatch
from ragkv.model.generate import prefill, step
from ragkv.model.llm import LoadedModel
from ragkv.modes.ape import attending


@dataclass
class Stepped:
    """What a decode step did: the requests `finished`, which left, each with its cache; the
    rows whose prompt is now in (`entered`: each has its first token); the requests whose
    prompt was going in when the forward failed (`failed`: out of the batch, with the error)."""

    finished: list[tuple[Request, object]]
    entered: list[Request]
    failed: list[tuple[Request, Exception]]


class Runner:
    """The running requests' caches and the forwards over them."""

    def __init__(self, lm: LoadedModel):
        self.lm = lm
        self.rows: list[Request] = []  # decoding together, in RaggedBatch row order
        self.solo: list[Request] = []  # decoding in forwards of their own: ape, and a plain request alone
        self._rows_batch: RaggedBatch | None = None  # made with the first row: an engine without weights has none
        self._packs: bool | None = None  # whether prompts ride along decode steps (packable), known at the first
        self.filling: dict[Request, list[int]] = {}  # rows whose prompt goes in: this step's chunk of it
        self.tokens_generated = 0  # since open

    @property
    def _batch(self) -> RaggedBatch:
        if self._rows_batch is None:
            self._rows_batch = RaggedBatch(self.lm.model.config)
        return self._rows_batch

    def prefill(self, request: Request, size: int | None) -> tuple[bool, bool]:
        """Prefill the next `size` ids of `request`'s prompt (None: all that is left); once its
        prompt is in, pick its first token. Touches only the request's own cache, unless the
        ids ride along the decode step (`_rides_along`): then its row joins the batch (once)
        and the ids wait for `decode`. Returns (whether its prompt is in, whether it is finished
        already)."""
        state = request.decode_state
        started = time.perf_counter()
        first = not request.started
        if first:
            request.started = True
            _catch_up(request)
        size = len(request.pending) if size is None else size
        chunk, request.pending = request.pending[:size], request.pending[size:]
        if self._rides_along(request):
            if request not in self.filling:  # its row joins now, holding what its cache holds
                self._batch_with(request)
            self.filling[request] = chunk
            state.prefill_s += time.perf_counter() - started
            return False, False  # its chunk goes in with this step's decode
        model = attending(self.lm.model, request.attention)
        logits = prefill(model, chunk, request.cache, request.recompute if first else None)
        state.prefill_s += time.perf_counter() - started
        if request.pending:
            return False, False
        if request.after_prefill is not None:
            request.after_prefill(request.cache)
        return True, self._take(request, logits)

    @property
    def packs(self) -> bool:
        """Whether the model takes packed steps (known once a row needs it)."""
        if self._packs is None:
            self._packs = packable(self.lm.model)
        return self._packs

    def _rides_along(self, request: Request) -> bool:
        """Whether `request`'s prompt goes in with the decode step (see the module docstring):
        a plain request on a packable model whose cache holds a context, while another plain
        one decodes."""
        if request in self.filling:
            return True
        plain = not request.attends_apart and request.recompute is None and request.after_prefill is None
        held = num_cached(request.cache) > 0  # a row joins holding something (its buffers take their shapes from it)
        return self.packs and plain and held and bool(self.rows or any(not r.attends_apart for r in self.solo))

    def join(self, request: Request) -> None:
        """`request`, its prompt in, starts decoding: in a forward of its own while it is alone
        (or attends apart), else a row of the batch, with the plain request that had the model to
        itself. A failure here may leave the batch half-changed: the caller fails every request
        and calls `reset`."""
        alone = [r for r in self.solo if not r.attends_apart]
        if request.attends_apart or not (self.rows or alone):
            self.solo.append(request)
            return
        self._batch_with(request)

    def _batch_with(self, request: Request) -> None:
        """`request` becomes a row of the batch, with the plain request that had the model to itself."""
        for row in [*[r for r in self.solo if not r.attends_apart], request]:
            self._batch.add(row.cache)
            if row in self.solo:
                self.solo.remove(row)
            self.rows.append(row)

    @torch.inference_mode()
    def decode(self) -> Stepped:
        """One token for every running request, and the chunk of each prompt going in as a row
        (see `Stepped`)."""
        size = len(self.rows) + len(self.solo)
        for request in [*self.rows, *self.solo]:
            request.max_rows = max(request.max_rows, size)
        finished: list[tuple[Request, object]] = []
        entered: list[Request] = []
        failed: list[tuple[Request, Exception]] = []
        if self.rows:
            try:
                logits = self._step_rows()  # (B, V)
            except Exception as exc:
                if not self.filling:
                    raise
                # The prompts going in take the blame: their rows leave, and the others, whose
                # lengths did not move (what the forward wrote past them is overwritten next
                # step), decode next step.
                failed = [(request, exc) for request in self.filling]
                for request, _ in failed:
                    self.release(request)
                return Stepped(finished, entered, failed)
            done = []
            for i, request in enumerate(self.rows):
                if request in self.filling:
                    if request.pending:  # more of its prompt next step
                        continue
                    del self.filling[request]
                    entered.append(request)
                if self._take(request, logits[i]):
                    done.append(i)
            finished += self._leave(done)
        for request in list(self.solo):
            if self._take(request, self._step_alone(request)):
                self.solo.remove(request)
                finished.append((request, request.cache))
        return Stepped(finished, entered, failed)

    def _step_alone(self, request: Request) -> torch.Tensor:
        """A request decoding alone: one token on its own cache, written out where
        `ragkv.kv.direct` serves the model and the cache; logits `(V,)`."""
        token, cache = request.decode_state.to_feed(), request.cache
        if not request.attends_apart and direct.serves_alone(self.lm.model, cache):
            return direct.step_alone(self.lm.model, token, cache)
        return step(attending(self.lm.model, request.attention), token, cache)

    def _step_rows(self):
        """The rows' forward: a packed one while a prompt goes in (or always, on a packable
        model), else the padded decode step."""
        model = self.lm.model
        if not self.filling and not self.packs:
            return self._batch.step(model, [r.decode_state.to_feed() for r in self.rows])
        started = time.perf_counter()
        logits = self._batch.step_packed(model, [self.filling.get(r) or [r.decode_state.to_feed()] for r in self.rows])
        for request in self.filling:
            request.decode_state.prefill_s += time.perf_counter() - started
        return logits

    def release(self, request: Request):
        """Take `request` out of the running ones (cancelled): its cache, or None if its prompt
        was not in yet."""
        if request in self.rows:
            index = self.rows.index(request)
            if self.filling.pop(request, None) is not None:  # its prompt was going in: nothing to hand back
                self.rows = [self.rows[i] for i in self._batch.remove([index])]
                return None
            return self._leave([index])[0][1]
        if request in self.solo:
            self.solo.remove(request)
            return request.cache
        return None

    def reset(self) -> None:
        """Forget every running request (after a failed step: the batch may be half-changed)."""
        self.rows, self.solo, self.filling = [], [], {}
        self._rows_batch = None

    def _take(self, request: Request, logits: torch.Tensor) -> bool:
        """Pick the request's next token from `logits`; returns whether it is finished."""
        state = request.decode_state
        had = len(state.token_ids)
        finished = state.take(logits)
        self.tokens_generated += len(state.token_ids) - had
        if state.delta and request.on_text is not None:
            request.on_text(state.delta)
        return finished

    def _leave(self, indices: list[int]) -> list[tuple[Request, object]]:
        """Rows `indices` leave the batch, each with its own cache, grown by what the batch
        computed for it."""
        left = [(self.rows[i], self._batch.hand_back(i, self.rows[i].cache)) for i in indices]
        if indices:
            self.rows = [self.rows[i] for i in self._batch.remove(indices)]
        return left


def _catch_up(request: Request) -> None:
    """As `request`'s prefill starts: what a request admitted with it over the same context has
    prefilled since (the prefix cache) joins its cache instead of being prefilled again."""
    if request.catch_up is None or not (added := request.catch_up(request.cache)):
        return
    request.pending = request.pending[added:]
    request.caught_up = added
