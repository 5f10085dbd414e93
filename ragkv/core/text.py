"""User text that no tokenizer takes: refused at the edge in one line, before any model work."""

from __future__ import annotations

from ragkv.core.errors import InputError


def check_text(text: str, what: str = "the question") -> str:
    """`text`, if it can be encoded as UTF-8; else an InputError naming the first bad character.
    Such text comes from bytes that were not UTF-8 (Python keeps them as lone surrogates: a
    command-line argument, a JSON "\\ud800" escape) and no tokenizer takes it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        what_char = f"the byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"a lone surrogate U+{code:04X}"
        raise InputError(
            f"{what} is not valid UTF-8 text: character {exc.start} is {what_char}; send UTF-8 text"
        ) from None
    return text


def listed(names) -> str:
    """`names` (keys a user wrote) for a one-line message: each quoted, so a newline or an empty
    name shows as itself, and cut to 80 characters."""
    return ", ".join(repr(name)[:80] for name in names)
