"""What one caller may read, and whose caches it shares: a `Scope`.

An app that serves several teams gives each caller a scope (`ragkv serve --keys` does it per
API key; `ragkv.open(store, scope=...)` and every call's `scope=` do it in Python):

- `filters`: every retrieval is ANDed with them (ragkv.core.filters' grammar, `or` included).
  A document they do not admit does not exist for the caller: naming it in `doc_ids` answers
  as an unknown document does, and given chunk ids of it are "not in the store";
- `tenant`: the in-process caches one request fills and another may hit (assembled
  multi-chunk prefixes, conversations kept between requests) are keyed by it as well as by
  content, so a tenant never hits what another computed. Stored document KV stays shared
  between tenants who may all read the document: that is the saving the store exists for.

A client's own filters only narrow its scope; nothing a request sends can widen it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from ragkv.core.errors import InputError
from ragkv.core.filters import Condition, parse_filters
from ragkv.core.text import listed

MAX_TENANT_CHARS = 128
T = TypeVar("T")


@dataclass(frozen=True)
class Scope:
    """A caller's reach: the documents its `filters` admit, in its `tenant`'s caches."""

    tenant: str = ""  # "" shares the caches of every caller without a tenant
    filters: tuple[str, ...] = ()  # all must hold (each may join comparisons with `or`)

    def __post_init__(self):
        if not isinstance(self.tenant, str) or len(self.tenant) > MAX_TENANT_CHARS or "\n" in self.tenant:
            raise InputError(f"a scope's tenant is a name of at most {MAX_TENANT_CHARS} characters on one line")
        object.__setattr__(self, "filters", tuple(f.to_string() for f in parse_filters(self.filters)))

    @classmethod
    def of(cls, given: Scope | Mapping[str, Any] | None) -> Scope | None:
        """A Scope from a Scope, a mapping of its fields (unknown keys are an error) or None."""
        if given is None or isinstance(given, Scope):
            return given
        if not isinstance(given, Mapping):
            raise InputError(
                f"a scope is a ragkv.Scope or a mapping with tenant and filters, got {type(given).__name__}"
            )
        unknown = sorted(set(given) - {f.name for f in fields(cls)})
        if unknown:
            raise InputError(f"unknown scope field(s): {listed(unknown)} (a scope has tenant and filters)")
        filters = given.get("filters", ())
        return cls(given.get("tenant", ""), (filters,) if isinstance(filters, str) else tuple(filters))

    @property
    def conditions(self) -> tuple[Condition, ...]:
        return parse_filters(self.filters)

    def within(self, outer: Scope | None) -> Scope:
        """This scope inside `outer` (an engine's own): both's filters hold; the tenant is this
        one's, or the outer's when this names none."""
        if outer is None:
            return self
        filters = outer.filters + tuple(f for f in self.filters if f not in outer.filters)
        return Scope(self.tenant or outer.tenant, filters)


def narrowest(inner: Scope | None, outer: Scope | None) -> Scope | None:
    """`inner` within `outer` (either may be None)."""
    if inner is None:
        return outer
    return inner.within(outer)


def bounded(settings: T, outer: Scope | None) -> T:
    """`settings` (search or ask settings: a frozen dataclass with a `scope`) with their scope
    inside `outer`: an engine's own, or a caller's key's. Unchanged when `outer` is None."""
    if outer is None:
        return settings
    return dataclasses.replace(settings, scope=narrowest(settings.scope, outer))  # type: ignore[attr-defined,type-var]


def cache_salt(scope: Scope | None) -> str:
    """The one salt of every per-tenant cache: what keys a request's entries in the in-process
    caches (the prefix cache, the RAM tier when tenants are isolated, kept conversations by
    scope), and what the vLLM front's secret salt is derived from: its scope's tenant ("" for
    none). The tenant's name itself is enough where no client can name a salt."""
    return scope.tenant if scope is not None else ""
