"""Who may call a front, and which store answers them (both fronts: ragkv.serve.service and
ragkv.serve.vllm_front).

- `Access` is the routes' dependency: it reads `Authorization: Bearer KEY` and returns the
  `Caller` the key stands for (ragkv.serve.api_keys), or refuses: 401 for a missing or wrong key,
  429 with Retry-After past the key's rate. Without `--api-key` or `--keys` everyone is one
  unscoped caller; `--api-key` alone admits its holder unscoped.
- The store a route answers from is opened for the caller (ragkv.serve.stores): the OpenAI
  `model` field picks one, and a store the caller may not use answers as one that does not
  exist (`UnknownModel`).
"""

from __future__ import annotations

import hmac

from fastapi import Request

from ragkv.serve.api_keys import ANYONE, Caller, KeyRing, RateLimits

SERVED_MODEL_ID = "ragkv"  # the id of the one store a plain `ragkv serve` serves; requests may also name the LLM


class Unauthorised(Exception):
    pass


class RateLimited(Exception):
    def __init__(self, wait_s: float):
        super().__init__(wait_s)
        self.wait_s = wait_s


class Forbidden(Exception):
    """What the caller's key may not see, though it may call (a 403 naming why)."""


class UnknownModel(Exception):
    """A `model` the caller may not use (whether or not it exists): answered as a 404 that
    names only the caller's own stores."""

    def __init__(self, model: str, allowed: list[str]):
        super().__init__(model)
        self.model, self.allowed = model, allowed


class Access:
    """The routes' dependency: the `Caller` a request's key stands for (see the module docstring)."""

    def __init__(self, api_key: str | None = None, keys: KeyRing | None = None):
        self.api_key = api_key
        self.keys = keys
        self.limits = RateLimits()

    @property
    def is_open(self) -> bool:
        return self.api_key is None and self.keys is None

    async def __call__(self, request: Request) -> Caller:
        caller = self.caller_of(request.headers.get("authorization", ""))
        wait_s = self.limits.wait_s(caller)
        if wait_s > 0:
            raise RateLimited(wait_s)
        request.state.caller = caller
        return caller

    def caller_of(self, authorization: str) -> Caller:
        """The caller an Authorization header stands for; Unauthorised when none."""
        if self.is_open:
            return ANYONE
        scheme, _, sent = authorization.partition(" ")
        sent = sent.strip() if scheme.lower() == "bearer" else ""
        if self.api_key is not None and hmac.compare_digest(sent.encode(), self.api_key.encode()):
            return ANYONE
        caller = self.keys.find(sent) if self.keys is not None and sent else None
        if caller is None:
            raise Unauthorised()
        return caller


def require_unfiltered(caller: Caller, why: str) -> None:
    """Forbidden for a key with filters, where a route's answer is about every document or
    every tenant (`why` says which)."""
    if caller.scope is not None and caller.scope.filters:
        raise Forbidden(f"{why}: it needs a key without filters")
