"""Split a document into chunks of at most `max_tokens` LLM tokens, on paragraph boundaries
where possible, then sentence boundaries, then (for a run-on sentence) the last safe point
that fits: after a comma or a space, else between two CJK characters, never inside a number
or a word.

Sentences end at `.!?;:` followed by white space (not after a list number such as "4."), and at
the CJK and full-width sentence ends `。！？；：．` (which need no space after them; Chinese and
Japanese text has none).
Pieces are joined back with the white space that separated them (none between CJK
sentences). Token counts are exact: every chunk is checked by tokenising it as it will be
stored.

A document with structure (headings, pages: ragkv.pipelines.reading.blocks) is chunked by its sections
(`chunk_blocks`): a section that fits in `max_tokens` is never split between chunks (a short
one shares a chunk with its neighbours rather than becoming a crumb); one that does not fit is
split by its subsections the same way, and at the bottom by paragraphs and sentences as above.
Each chunk records its section path (the deepest section holding all of it) and the pages it
covers. A document with no headings and no pages is chunked exactly as by `chunk_text`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from ragkv.model.prompt import encode_text
from ragkv.pipelines.reading.blocks import Block, paths

CHUNKER_VERSION = "2"  # plain text: chunk_text
SECTIONS_VERSION = "3"  # documents with headings or pages: chunk_blocks
# "4. Watch the panel": a list number ("4.", "12.") ends no sentence.
_SENTENCE_END = re.compile(r"(?<!\b\d\.)(?<!\b\d\d\.)(?<=[.!?;:])\s+|(?<=[。！？；：．])\s*")
_SOFT_BREAK = set("，、,;；:：)）」』》】”’")  # a cut right after one of these keeps phrases whole


@dataclass(frozen=True)
class Piece:
    text: str
    joiner: str  # what separated it from the piece before: "\n\n" (new paragraph), " " or ""


def chunking_id(max_tokens: int, structured: bool = False) -> str:
    """Identity of a chunking: a document chunked under another id must be chunked again.

    The tokenizer is deliberately not part of it: chunks are text, and a model with another
    tokenizer reuses them (and their embeddings), computing only its own KV; the old model's
    KV stays linked and usable. Its token count may then differ a little from `max_tokens`,
    which `ingest` checks against the context. `structured`: a document with headings or pages,
    chunked by its sections (`chunk_blocks`)."""
    return f"v{SECTIONS_VERSION if structured else CHUNKER_VERSION}:tokens={max_tokens}"


def is_structured(blocks: Sequence[Block]) -> bool:
    return any(b.level or b.page is not None for b in blocks)


@dataclass(frozen=True)
class Chunk:
    """A chunk's text and its place: the deepest section holding all of it, the pages it covers."""

    text: str
    section: tuple[str, ...] = ()  # headings, outermost first
    pages: tuple[int, int] | None = None  # first and last page (or slide); None: the format has none


@dataclass(frozen=True)
class _Unit:
    piece: Piece
    path: tuple[str, ...]
    level: int  # the heading level it opens (0: body)
    page: int | None


def chunk_blocks(blocks: Sequence[Block], tokenizer, max_tokens: int) -> list[Chunk]:
    """Chunks of a document's blocks, in order, each at most `max_tokens` tokens, sections kept
    whole where they fit (see the module)."""
    # A heading never ends a chunk away from its text: the pieces of a long paragraph leave room
    # for a heading of each level before them.
    longest: dict[int, int] = {}
    for block in blocks:
        if block.level:
            longest[block.level] = max(longest.get(block.level, 0), _count(tokenizer, block.text) + 1)
    reserve = sum(longest.values())
    room = max(max_tokens - reserve, max_tokens // 2)
    units = []
    for block, path in zip(blocks, paths(blocks), strict=True):
        for index, piece in enumerate(_pieces(block.text, tokenizer, max_tokens if block.level else room)):
            joiner = block.joiner if index == 0 else piece.joiner
            units.append(_Unit(Piece(piece.text, joiner), path, block.level if index == 0 else 0, block.page))
    levels = sorted({u.level for u in units if u.level})
    groups = _pack(units, levels, tokenizer, max_tokens)
    return [_chunk(group) for group in groups if group]


def _pack(units: list[_Unit], levels: list[int], tokenizer, max_tokens: int) -> list[list[_Unit]]:
    """`units` packed into chunks: split into sections at the headings of `levels[0]` (or
    higher), each section whole where it fits (with its neighbours while they fit too), an
    oversized one packed by the levels below, at the bottom piece by piece."""
    if not levels:
        return _pack_pieces(units, tokenizer, max_tokens)
    sections: list[list[_Unit]] = []
    for unit in units:
        if not sections or (unit.level and unit.level <= levels[0]):
            sections.append([])
        sections[-1].append(unit)
    chunks: list[list[_Unit]] = []
    current: list[_Unit] = []
    for section in sections:
        if current and all(u.level for u in current):  # headings alone (a title): they open what follows
            section, current = current + section, []
        if _fits(current + section, tokenizer, max_tokens):
            current = current + section
            continue
        if _fits(section, tokenizer, max_tokens):
            chunks += [current] if current else []
            current = section
            continue
        inner = _pack(section, levels[1:], tokenizer, max_tokens)
        if current and inner and _fits(current + inner[0], tokenizer, max_tokens):
            inner[0] = current + inner[0]  # short sections before it join its first part, whole
        elif current:
            chunks.append(current)
        chunks += inner[:-1]
        current = inner[-1] if inner else []  # its last part may take the next short sections
    if current:
        chunks.append(current)
    return chunks


def _pack_pieces(units: list[_Unit], tokenizer, max_tokens: int) -> list[list[_Unit]]:
    chunks: list[list[_Unit]] = []
    current: list[_Unit] = []
    for unit in units:
        if current and not _fits(current + [unit], tokenizer, max_tokens):
            carried: list[_Unit] = []
            while len(current) > 1 and current[-1].level:  # its heading goes with the text after it
                carried.insert(0, current.pop())
            chunks.append(current)
            current = carried if _fits(carried + [unit], tokenizer, max_tokens) else []
            if not current and carried:
                chunks[-1] = chunks[-1] + carried
        current.append(unit)
    if current:
        chunks.append(current)
    return chunks


def _joined(units: Sequence[_Unit]) -> str:
    return "".join((u.piece.joiner if i else "") + u.piece.text for i, u in enumerate(units))


def _fits(units: Sequence[_Unit], tokenizer, max_tokens: int) -> bool:
    return bool(units) and _count(tokenizer, _joined(units)) <= max_tokens


def _chunk(units: list[_Unit]) -> Chunk:
    pages = [u.page for u in units if u.page is not None]
    return Chunk(_joined(units), _common(u.path for u in units), (min(pages), max(pages)) if pages else None)


def _common(paths) -> tuple[str, ...]:
    """The longest path every one of `paths` starts with: the deepest section holding them all."""
    common: tuple[str, ...] | None = None
    for path in paths:
        if common is None:
            common = path
            continue
        size = 0
        while size < min(len(common), len(path)) and common[size] == path[size]:
            size += 1
        common = common[:size]
    return common or ()


def chunk_text(text: str, tokenizer, max_tokens: int) -> list[str]:
    """Chunks of `text`, in order, each at most `max_tokens` tokens."""
    chunks: list[str] = []
    current = ""
    for piece in _pieces(text, tokenizer, max_tokens):
        if not current:
            current = piece.text
            continue
        candidate = current + piece.joiner + piece.text
        if _count(tokenizer, candidate) <= max_tokens:
            current = candidate
        else:
            chunks.append(current)
            current = piece.text
    if current:
        chunks.append(current)
    return chunks


def _pieces(text: str, tokenizer, max_tokens: int):
    """Paragraphs that fit, else their sentences, else windows of a sentence."""
    for paragraph in re.split(r"\n\s*\n", text):
        paragraph = paragraph.strip()
        if not paragraph:
            continue
        if _count(tokenizer, paragraph) <= max_tokens:
            yield Piece(paragraph, "\n\n")
            continue
        first = True
        for sentence, gap in _split(paragraph, _SENTENCE_END):
            fits = _count(tokenizer, sentence) <= max_tokens
            for index, (part, part_gap) in enumerate(
                [(sentence, gap)] if fits else _windows(sentence, tokenizer, max_tokens)
            ):
                yield Piece(part, "\n\n" if first else _joiner(gap if index == 0 else part_gap))
                first = False


def _split(text: str, pattern: re.Pattern) -> list[tuple[str, str]]:
    """Non-empty pieces of `text` between matches of `pattern`, each with the text that
    separated it from the previous piece."""
    pieces, start, gap = [], 0, ""
    for match in pattern.finditer(text):
        if match.end() == 0 or match.start() < start:
            continue
        if piece := text[start : match.start()]:
            pieces.append((piece, gap))
            gap = ""
        gap += match.group()
        start = match.end()
    if piece := text[start:]:
        pieces.append((piece, gap))
    return pieces


def _joiner(gap: str) -> str:
    return " " if gap and gap.isspace() or " " in gap else ""


def _is_cjk(char: str) -> bool:
    code = ord(char)
    return (
        0x3040 <= code <= 0x30FF
        or 0x3400 <= code <= 0x4DBF
        or 0x4E00 <= code <= 0x9FFF
        or 0xAC00 <= code <= 0xD7AF
        or 0xF900 <= code <= 0xFAFF
    )


def _cut_quality(text: str, at: int) -> int:
    """How good a place `at` (a character index) is to cut a run-on sentence: 2 after white
    space or a comma-like mark, 1 between two CJK characters, 0 inside a word or a number."""
    if at <= 0 or at >= len(text):
        return 2
    left, right = text[at - 1], text[at]
    if left.isspace() or right.isspace() or left in _SOFT_BREAK:
        return 2
    if _is_cjk(left) and _is_cjk(right):
        return 1
    return 0


def _windows(text: str, tokenizer, max_tokens: int) -> list[tuple[str, str]]:
    """Cut `text` into parts of at most `max_tokens` tokens each, at the best token boundary
    of the last half of each window (see `_cut_quality`); each part with the white space
    before it."""
    offsets = tokenizer(text, add_special_tokens=False, split_special_tokens=True, return_offsets_mapping=True)[
        "offset_mapping"
    ]
    parts, start_token, previous_end = [], 0, 0
    while start_token < len(offsets):
        size = max_tokens
        while True:
            stop_token = _best_stop(text, offsets, start_token, min(start_token + size, len(offsets)))
            begin = offsets[start_token][0]
            end = offsets[stop_token][0] if stop_token < len(offsets) else len(text)
            part = text[begin:end].strip()
            # Re-tokenising a cut piece can take a token more than its offsets said.
            if _count(tokenizer, part) <= max_tokens or size == 1:
                break
            size -= max(1, size // 16)
        if part:
            parts.append((part, text[previous_end:begin]))
            previous_end = end
        start_token = stop_token
    return parts


def _best_stop(text: str, offsets, start_token: int, stop_token: int) -> int:
    """The token index to end a window at: the last one in (start, stop] whose boundary cuts
    best, looking back at most half the window; `stop_token` itself when nothing better."""
    if stop_token >= len(offsets):
        return stop_token
    best, best_quality = stop_token, _cut_quality(text, offsets[stop_token][0])
    lowest = start_token + max(1, (stop_token - start_token) // 2)
    for token in range(stop_token, lowest - 1, -1):
        quality = _cut_quality(text, offsets[token][0])
        if quality > best_quality:
            best, best_quality = token, quality
            if quality == 2:
                break
    return best


def _count(tokenizer, text: str) -> int:
    return len(encode_text(tokenizer, text))
