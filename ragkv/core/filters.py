"""Metadata filters (`--filter`): which documents a retrieval may return.

The grammar, one condition per `--filter` (several are all required):

    FIELD OP VALUE [or FIELD OP VALUE ...]
    FIELD  a document field: id, path, title, modified, format, source, or a field of the
           document's metadata (a jsonl record's other keys, e.g. year, category)
    OP     =  !=  >  >=  <  <=
    VALUE  the rest of the condition, spaces around it trimmed; with = and != a `*` matches
           any run of characters and `?` one character (path=runbooks/*)

A condition of several comparisons joined by `or` holds when any of them does
(`path=handbook/* or team=hr`); a value holding the word itself is quoted (title='War or Peace').
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
    "'modified>=2025-06-01'), or several joined by 'or' ('path=handbook/* or team=hr'); = and != take * and ? "
    "wildcards"
)
MAX_ALTERNATIVES = 32  # comparisons one `or` condition may join
# " or " between comparisons, not inside a quoted value (an even number of quotes follows it)
_OR = re.compile(r"\s+or\s+(?=(?:[^'\"]*['\"][^'\"]*['\"])*[^'\"]*$)", re.IGNORECASE)
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

    @property
    def comparisons(self) -> tuple[Filter, ...]:
        return (self,)

    def to_string(self) -> str:
        return f"{self.field}{self.op}{_quoted(self.value)}"


@dataclass(frozen=True)
class AnyOf:
    """Several comparisons joined by `or`: documents for which any of them holds."""

    options: tuple[Filter, ...]

    @property
    def comparisons(self) -> tuple[Filter, ...]:
        return self.options

    def to_string(self) -> str:
        return " or ".join(option.to_string() for option in self.options)


Condition = Filter | AnyOf


def parse_filter(text: str) -> Condition:
    """One `--filter` condition (a comparison, or several joined by `or`); InputError naming the
    grammar when it is not one."""
    if not isinstance(text, str) or len(text) > 4096:
        raise InputError(f"filter {str(text)[:80]!r} is not a condition: {GRAMMAR}")
    parts = _OR.split(text)
    if len(parts) > MAX_ALTERNATIVES:
        raise InputError(f"filter {text[:80]!r} joins more than {MAX_ALTERNATIVES} comparisons with 'or'")
    if len(parts) == 1:
        return _comparison(text)
    return AnyOf(tuple(_comparison(part) for part in parts))


def _quoted(value: str) -> str:
    """`value` as the grammar reads it back: quoted when it holds a comparison or the word or."""
    if not (any(o in value for o in "=<>") or _OR.search(f"x {value} x")):
        return value
    quote = '"' if "'" in value else "'"
    return f"{quote}{value}{quote}"


def _comparison(text: str) -> Filter:
    found = _CONDITION.match(text)
    if found is None or not found[3]:
        raise InputError(f"filter {text!r} is not a condition: {GRAMMAR}")
    field, op, value = found[1], found[2], found[3]
    if not _FIELD.match(field):
        raise InputError(f"filter {text!r} names no field ({field!r} is not a field name): {GRAMMAR}")
    if any(o in value for o in ("=", "<", ">")) and not value.startswith(("'", '"')):
        raise InputError(f"filter {text!r} has more than one comparison: {GRAMMAR}")
    return Filter(field, op, value.strip("'\""))


def parse_filters(texts: Sequence[str]) -> tuple[Condition, ...]:
    if isinstance(texts, str):
        texts = (texts,)
    return tuple(parse_filter(t) for t in texts)


def check_fields(filters: Sequence[Condition], known: Sequence[str]) -> None:
    """InputError naming the first filter field that is neither built in nor one of `known`
    (the store's metadata fields)."""
    fields = sorted(set(BUILT_IN) | set(known))
    for condition in (c for f in filters for c in f.comparisons):
        if condition.field not in fields:
            raise InputError(
                f"unknown filter field {condition.field!r}; this store's documents have: {', '.join(fields)}"
                f" ({GRAMMAR})"
            )
