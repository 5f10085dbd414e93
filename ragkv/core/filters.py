"""Metadata filters (`--filter`): which documents a retrieval may return.

The grammar, one condition per `--filter` (several are all required):

    FIELD OP VALUE
    FIELD  a document field: id, path, title, modified, format, source, or a field of the
           document's metadata (a jsonl record's other keys, e.g. year, category)
    OP     =  !=  >  >=  <  <=
    VALUE  the rest of the condition, spaces around it trimmed; with = and != a `*` matches
           any run of characters and `?` one character (path=runbooks/*)

A value that reads as a number is compared as one (year>=2025); otherwise as text, so ISO
dates compare in time order (modified>=2025-06-01). A document without the field never
matches. Filters are values, never SQL: the store binds them as parameters.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from ragkv.core.errors import InputError

OPERATORS = ("!=", ">=", "<=", "=", ">", "<")  # longest first, so ">=" is not read as ">"
BUILT_IN = ("id", "path", "title", "modified", "format", "source")
GRAMMAR = (
    "a filter is FIELD OP VALUE with OP one of = != > >= < <= (e.g. 'path=runbooks/*', 'year>=2025', "
    "'modified>=2025-06-01'); = and != take * and ? wildcards"
)
_FIELD = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]{0,63}$")
_CONDITION = re.compile(r"^\s*([^=!<>\s]+)\s*(!=|>=|<=|=|>|<)\s*(.*?)\s*$", re.DOTALL)


@dataclass(frozen=True)
class Filter:
    """One condition: documents whose `field` compares to `value` by `op`."""

    field: str
    op: str
    value: str

    @property
    def number(self) -> float | None:
        """The value as a number, when it reads as one."""
        try:
            return float(self.value)
        except ValueError:
            return None

    @property
    def is_pattern(self) -> bool:
        return self.op in ("=", "!=") and any(c in self.value for c in "*?")

    def to_string(self) -> str:
        return f"{self.field}{self.op}{self.value}"


def parse_filter(text: str) -> Filter:
    """One `--filter` condition; InputError naming the grammar when it is not one."""
    if not isinstance(text, str) or len(text) > 1024:
        raise InputError(f"filter {str(text)[:80]!r} is not a condition: {GRAMMAR}")
    found = _CONDITION.match(text)
    if found is None or not found[3]:
        raise InputError(f"filter {text!r} is not a condition: {GRAMMAR}")
    field, op, value = found[1], found[2], found[3]
    if not _FIELD.match(field):
        raise InputError(f"filter {text!r} names no field ({field!r} is not a field name): {GRAMMAR}")
    if any(o in value for o in ("=", "<", ">")) and not value.startswith(("'", '"')):
        raise InputError(f"filter {text!r} has more than one comparison: {GRAMMAR}")
    return Filter(field, op, value.strip("'\""))


def parse_filters(texts: Sequence[str]) -> tuple[Filter, ...]:
    if isinstance(texts, str):
        texts = (texts,)
    return tuple(parse_filter(t) for t in texts)


def check_fields(filters: Sequence[Filter], known: Sequence[str]) -> None:
    """InputError naming the first filter field that is neither built in nor one of `known`
    (the store's metadata fields)."""
    fields = sorted(set(BUILT_IN) | set(known))
    for condition in filters:
        if condition.field not in fields:
            raise InputError(
                f"unknown filter field {condition.field!r}; this store's documents have: {', '.join(fields)}"
                f" ({GRAMMAR})"
            )
