"""The model's side of a step (nano-vllm's `ModelRunner`): the forwards and the sampling. It
prefills the chunk of a request's prompt the scheduler chose and picks its first token, and
decodes every running request by one token: the rows together in one forward (`RaggedBatch`:
each row's tokens in a slot of its own, a padding mask, per-row positions), and a request that
attends in its own way (`--mode ape`) in a forward of its own. A request decoding alone steps
its own cache (no copy into a batch and back: the plain loop); the next one to finish its
prefill brings it into the batch. Every token is chosen by the request's own `Decoder`, so in
float32 an answer from inside a batch equals the same question asked alone (tested)."""

from __future__ import annotations

import time

import torch

from ragkv.engine.request import Request
from ragkv.kv.ragged import RaggedBatch
from ragkv.model.generate import prefill, step
from ragkv.model.llm import LoadedModel
from ragkv.modes.ape import attending


class Runner:
    """The running requests' caches and the forwards over them."""

    def __init__(self, lm: LoadedModel):
        self.lm = lm
        self.rows: list[Request] = []  # decoding together, in RaggedBatch row order
        self.solo: list[Request] = []  # decoding in forwards of their own: ape, and a plain request alone
        self._rows_batch: RaggedBatch | None = None  # made with the first row: an engine without weights has none
        self.tokens_generated = 0  # since open

    @property
    def _batch(self) -> RaggedBatch:
        if self._rows_batch is None:
            self._rows_batch = RaggedBatch(self.lm.model.config)
        return self._rows_batch

    def prefill(self, request: Request, size: int | None) -> tuple[bool, bool]:
        """Prefill the next `size` ids of `request`'s prompt (None: all that is left); once its
        prompt is in, pick its first token. Touches only the request's own cache. Returns
        (whether its prompt is in, whether it is finished already)."""
        plan, state = request.turn_plan, request.decode_state
        started = time.perf_counter()
        first = not request.started
        if first:
            request.started = True
            _catch_up(request)
        size = len(request.pending) if size is None else size
        chunk, request.pending = request.pending[:size], request.pending[size:]
        model = attending(self.lm.model, plan.attention)
        logits = prefill(model, chunk, plan.cache, plan.recompute if first else None)
        state.prefill_s += time.perf_counter() - started
        if request.pending:
            return False, False
        if plan.after_prefill is not None:
            plan.after_prefill(plan.cache)
        return True, self._take(request, logits)

    def join(self, request: Request) -> None:
        """`request`, its prompt in, starts decoding: in a forward of its own while it is alone
        (or attends apart), else a row of the batch, with the plain request that had the model to
        itself. A failure here may leave the batch half-changed: the caller fails every request
        and calls `reset`."""
        alone = [r for r in self.solo if not r.attends_apart]
        if request.attends_apart or not (self.rows or alone):
            self.solo.append(request)
            return
        for row in [*alone, request]:
            self._batch.add(row.turn_plan.cache)
            if row in self.solo:
                self.solo.remove(row)
            self.rows.append(row)

    @torch.inference_mode()
    def decode(self) -> list[tuple[Request, object]]:
        """One token for every running request; the finished ones leave, each with its cache."""
        size = len(self.rows) + len(self.solo)
        for request in [*self.rows, *self.solo]:
            request.max_rows = max(request.max_rows, size)
        finished = []
        if self.rows:
            logits = self._batch.step(self.lm.model, [r.decode_state.to_feed() for r in self.rows])  # (B, V)
            finished += self._leave([i for i, r in enumerate(self.rows) if self._take(r, logits[i])])
        for request in list(self.solo):
            model = attending(self.lm.model, request.turn_plan.attention)
            if self._take(request, step(model, request.decode_state.to_feed(), request.turn_plan.cache)):  # logits (V,)
                self.solo.remove(request)
                finished.append((request, request.turn_plan.cache))
        return finished

    def release(self, request: Request):
        """Take `request` out of the running ones (cancelled): its cache, or None if its prompt
        was not in yet."""
        if request in self.rows:
            return self._leave([self.rows.index(request)])[0][1]
        if request in self.solo:
            self.solo.remove(request)
            return request.turn_plan.cache
        return None

    def reset(self) -> None:
        """Forget every running request (after a failed step: the batch may be half-changed)."""
        self.rows, self.solo = [], []
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
        """Rows `indices` leave the batch, each with its cache copied out."""
        left = [(self.rows[i], self._batch.extract(i)) for i in indices]
        if indices:
            self.rows = [self.rows[i] for i in self._batch.remove(indices)]
        return left


def _catch_up(request: Request) -> None:
    """As `request`'s prefill starts: what a request admitted with it over the same context has
    prefilled since (the prefix cache) joins its cache instead of being prefilled again."""
    plan = request.turn_plan
    if plan.catch_up is None or not (added := plan.catch_up(plan.cache)):
        return
    request.pending = request.pending[added:]
    request.caught_up = added
