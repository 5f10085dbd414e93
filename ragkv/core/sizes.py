"""Sizes in bytes as users write them (`--kv-budget 20GB`, `--pending-bytes 512MiB`)."""

from __future__ import annotations

import re

from ragkv.core.errors import InputError

MAX_SIZE = 1 << 62  # bytes: sizes are kept in 64-bit integers (the catalog's BIGINT)
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "m": 1000**2,
    "g": 1000**3,
    "t": 1000**4,
    "ki": 1024,
    "mi": 1024**2,
    "gi": 1024**3,
    "ti": 1024**4,
}


def parse_precompute(text: str) -> int | None:
    """`--precompute`: all (None: as much as the budget holds), none (0), or a size in bytes."""
    limits: dict[str, int | None] = {"all": None, "none": 0}
    return limits[text] if text in limits else parse_size(text, "--precompute (all, none or a size)")


def parse_size(text: str, what: str = "size") -> int:
    """Bytes in a size such as "20GB", "512MiB", "1.5G" or "4096" (GB = 10^9, GiB = 2^30)."""
    match = _SIZE.match(str(text))
    if not match:
        raise InputError(f"{what} {text!r} is not a size; write e.g. 20GB, 512MiB or 4096 (bytes)")
    unit = (match.group(2) or "").lower().removesuffix("b")
    size = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if size > MAX_SIZE:
        raise InputError(f"{what} {text!r} is over the largest size ragkv takes (4 EiB)")
    return size
