"""Who may call a front, and which store answers them (both fronts: ragkv.serve.service and
ragkv.serve.vllm_front).

- `Access` is the routes' dependency: it reads `Authorization: Bearer KEY` and returns the
  `Caller` the key stands for (ragkv.serve.keys), or refuses: 401 for a missing or wrong key,
  429 with Retry-After past the key's rate. Without `--api-key` or `--keys` everyone is one
  unscoped caller; `--api-key` alone admits its holder unscoped.
- `Stores` are the stores served, by name: the OpenAI `model` field picks one. A store the
  caller may not use answers as one that does not exist, and `/v1/models` lists only the
  caller's.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from typing import Any, TypeVar

from fastapi import Request

from ragkv.core.config import AskSettings, SearchSettings
from ragkv.core.scope import bounded
from ragkv.serve.keys import ANYONE, Caller, KeyRing, RateLimits

SERVED_MODEL_ID = "ragkv"  # the id of the one store a plain `ragkv serve` serves; requests may also name the LLM

S = TypeVar("S", AskSettings, SearchSettings)


class Unauthorised(Exception):
    pass


class RateLimited(Exception):
    def __init__(self, wait_s: float):
        super().__init__(wait_s)
        self.wait_s = wait_s


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


def scoped(settings: S, caller: Caller) -> S:
    """`settings` narrowed to the caller's scope: whatever the request said of its scope (it can
    say nothing: the request bodies have no such field) sits inside the caller's."""
    return bounded(settings, caller.scope)


class Stores:
    """The served stores' engines by name, in the order given (the first is the default)."""

    def __init__(self, engines: Mapping[str, Any], llm_name: str):
        self.engines: dict[str, Any] = dict(engines)
        self.llm_name = llm_name

    def names(self, caller: Caller) -> list[str]:
        return [name for name in self.engines if caller.may_use(name)]

    def select(self, model: str | None, caller: Caller) -> tuple[str, Any]:
        """(name, engine) of the store `model` names, for `caller`. No model, "ragkv" or the
        LLM's name: the caller's first store. UnknownModel otherwise, and for a store it may
        not use, alike."""
        allowed = self.names(caller)
        if model in allowed:
            return model, self.engines[model]
        if (model is None or model in (SERVED_MODEL_ID, self.llm_name)) and allowed:
            return allowed[0], self.engines[allowed[0]]
        raise UnknownModel(str(model), allowed)

    def listing(self, caller: Caller) -> dict:
        """What /v1/models answers `caller`: its stores, each with the LLM behind it as its root."""
        return {
            "object": "list",
            "data": [
                {"id": name, "object": "model", "created": 0, "owned_by": "ragkv", "root": self.llm_name}
                for name in self.names(caller)
            ],
        }
