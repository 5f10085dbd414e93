"""Split a document into chunks of at most `max_tokens` LLM tokens, on paragraph boundaries
where possible, then sentence boundaries, then (for a run-on sentence) token boundaries.

Token counts are exact: every chunk is checked by tokenising it as it will be stored.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ragkv.prompt import encode_text

CHUNKER_VERSION = "1"
_SENTENCE_END = re.compile(r"(?<=[.!?;:])\s+")


@dataclass(frozen=True)
class Piece:
    text: str
    starts_paragraph: bool


def chunking_id(max_tokens: int) -> str:
    """Identity of a chunking: a document chunked under another id must be chunked again.

    The tokenizer is deliberately not part of it: chunks are text, and a model with another
    tokenizer reuses them (and their embeddings), computing only its own KV; the old model's
    KV stays linked and usable. Its token count may then differ a little from `max_tokens`,
    which `ingest` checks against the context."""
    return f"v{CHUNKER_VERSION}:tokens={max_tokens}"


def chunk_text(text: str, tokenizer, max_tokens: int) -> list[str]:
    """Chunks of `text`, in order, each at most `max_tokens` tokens."""
    chunks: list[str] = []
    current = ""
    for piece in _pieces(text, tokenizer, max_tokens):
        if not current:
            current = piece.text
            continue
        candidate = current + ("\n\n" if piece.starts_paragraph else " ") + piece.text
        if _count(tokenizer, candidate) <= max_tokens:
            current = candidate
        else:
            chunks.append(current)
            current = piece.text
    if current:
        chunks.append(current)
    return chunks


def _pieces(text: str, tokenizer, max_tokens: int):
    """Paragraphs that fit, else their sentences, else token windows of a sentence."""
    for paragraph in re.split(r"\n\s*\n", text):
        paragraph = paragraph.strip()
        if not paragraph:
            continue
        if _count(tokenizer, paragraph) <= max_tokens:
            yield Piece(paragraph, True)
            continue
        first = True
        for sentence in _SENTENCE_END.split(paragraph):
            for part in [sentence] if _count(tokenizer, sentence) <= max_tokens else _windows(sentence, tokenizer, max_tokens):
                yield Piece(part, first)
                first = False


def _windows(text: str, tokenizer, max_tokens: int) -> list[str]:
    """Cut `text` at token offsets into parts of at most `max_tokens` tokens each."""
    offsets = tokenizer(text, add_special_tokens=False, split_special_tokens=True,
                        return_offsets_mapping=True)["offset_mapping"]
    parts, start_token = [], 0
    while start_token < len(offsets):
        size = max_tokens
        while True:
            stop_token = min(start_token + size, len(offsets))
            begin = offsets[start_token][0]
            end = offsets[stop_token][0] if stop_token < len(offsets) else len(text)
            part = text[begin:end].strip()
            # Re-tokenising a cut piece can take a token more than its offsets said.
            if _count(tokenizer, part) <= max_tokens or size == 1:
                break
            size -= max(1, size // 16)
        if part:
            parts.append(part)
        start_token = stop_token
    return parts


def _count(tokenizer, text: str) -> int:
    return len(encode_text(tokenizer, text))
