"""Read documents from files and directory trees: .txt .md .rst .html .jsonl, and .pdf .docx
.pptx (ragkv.pipelines.reading.documents). Each document's structure (headings, pages, table rows) comes
with it as blocks (ragkv.pipelines.reading.blocks).

Each document carries metadata a filter can use (ragkv.core.filters): its format, its path (the
id a file is stored under; a jsonl record: its file's), the file's modified time, a title (the
first heading; an HTML page's <title>), and a jsonl record's other fields.

A document's id is its path relative to the directory it was found under (or its file name
when a file was passed directly), or the `id` field of a jsonl record: stable across runs, so
re-ingesting the same tree finds the same documents.

Whatever cannot be read is listed as skipped with its reason, never an error that stops the
run: an unreadable file, a FIFO or socket, a broken link, a binary or non-UTF-8 file, and a
document over `max_document_bytes` (default 8 MiB of text, about 2M tokens: its KV alone would
take tens of GB; raise it with `--max-doc-bytes`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from ragkv.core.config import (
    DEFAULT_MAX_DOCUMENT_BYTES as MAX_DOCUMENT_BYTES,  # a jsonl file is not capped; each record is
)
from ragkv.core.errors import InputError
from ragkv.pipelines.reading.blocks import Block, html_blocks, markdown_blocks, plain_blocks, rst_blocks, text_of
from ragkv.pipelines.reading.chunk import is_structured
from ragkv.pipelines.reading.documents import DOCUMENT_SUFFIXES, UNPACKED_LIMIT, Unreadable, read_document

TEXT_SUFFIXES = {".txt", ".md", ".markdown", ".rst", ".text"}
HTML_SUFFIXES = {".html", ".htm"}
JSONL_SUFFIXES = {".jsonl"}
SUPPORTED = TEXT_SUFFIXES | HTML_SUFFIXES | JSONL_SUFFIXES | DOCUMENT_SUFFIXES


@dataclass(frozen=True)
class Document:
    doc_id: str
    source: str  # where it was read from (path, plus line for jsonl)
    text: str
    metadata: dict = field(default_factory=dict)
    blocks: tuple[Block, ...] = ()  # its structure (headings, pages), if any: see reading.blocks


@dataclass(frozen=True)
class Skipped:
    source: str
    reason: str


@dataclass
class ReadResult:
    documents: list[Document] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)


def read_documents(paths: Iterable[Path | str], max_document_bytes: int = MAX_DOCUMENT_BYTES) -> ReadResult:
    """Read every supported file under `paths`. Unusable files are listed in `skipped` with
    the reason; a path that does not exist is an InputError (checked before anything is read)."""
    roots = [Path(p) for p in paths]
    for root in roots:
        if not root.exists():
            raise InputError(f"path {root} does not exist; pass files or directories of documents")
    result = ReadResult()
    seen: set[str] = set()
    for root in roots:
        for path, doc_id in _walk(root):
            for item in _read_file(path, doc_id, max_document_bytes):
                if isinstance(item, Skipped):
                    result.skipped.append(item)
                elif item.doc_id in seen:
                    result.skipped.append(Skipped(item.source, f"duplicate document id {item.doc_id!r}"))
                else:
                    seen.add(item.doc_id)
                    result.documents.append(item)
    return result


def _walk(root: Path) -> Iterator[tuple[Path, str]]:
    """(entry, doc id) pairs under root, sorted: every entry but folders (so that what is not a
    regular file is listed as skipped); hidden files and folders are left out."""
    if not root.is_dir():
        yield root, root.name
        return
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(root)
        if not path.is_dir() and not any(part.startswith(".") for part in relative.parts):
            yield path, relative.as_posix()


def _read_file(path: Path, doc_id: str, max_document_bytes: int) -> Iterator[Document | Skipped]:
    suffix = path.suffix.lower()
    if not path.is_file():
        yield Skipped(str(path), "a broken symbolic link" if path.is_symlink() else "not a regular file")
        return
    if suffix not in SUPPORTED:
        yield Skipped(
            str(path), f"unsupported file type {suffix or '(none)'}; ragkv reads {', '.join(sorted(SUPPORTED))}"
        )
        return
    # A PDF or Office file holds images and markup beside its text: its file may be larger.
    max_file_bytes = UNPACKED_LIMIT * max_document_bytes if suffix in DOCUMENT_SUFFIXES else max_document_bytes
    try:
        size = path.stat().st_size
        if suffix not in JSONL_SUFFIXES and size > max_file_bytes:
            yield Skipped(str(path), _too_large(size, max_file_bytes))
            return
        where = {"path": doc_id, "modified": _modified(path)}  # a filter's fields (ragkv.core.filters)
        if suffix in DOCUMENT_SUFFIXES:
            yield _read_document(path, doc_id, suffix, max_document_bytes, where)
            return
        raw = path.read_bytes()
    except OSError as exc:
        yield Skipped(str(path), f"cannot be read: {exc.strerror or exc}")
        return
    if b"\x00" in raw[:8192]:
        yield Skipped(str(path), "binary file")
        return
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        yield Skipped(str(path), f"not valid UTF-8 (byte {exc.start})")
        return
    if suffix in JSONL_SUFFIXES:
        yield from _read_jsonl(path, text, max_document_bytes, where)
        return
    if suffix in HTML_SUFFIXES:
        title = html_title(text)
        blocks = html_blocks(text)
    else:
        text = normalise(text)
        reader = rst_blocks if suffix == ".rst" else plain_blocks if suffix in (".txt", ".text") else markdown_blocks
        blocks = reader(text)
        title = next((b.title for b in blocks if b.level), None)
    yield _document(doc_id, str(path), blocks, {"format": suffix.lstrip("."), **where}, title)


def _read_document(path: Path, doc_id: str, suffix: str, max_bytes: int, where: dict) -> Document | Skipped:
    try:
        read = read_document(path, max_bytes)
    except Unreadable as exc:
        return Skipped(str(path), str(exc))
    title = read.metadata.pop("title", None) or next((b.title for b in read.blocks if b.level), None)
    return _document(doc_id, str(path), read.blocks, {"format": suffix.lstrip("."), **where, **read.metadata}, title)


def _document(doc_id: str, source: str, blocks: list[Block], metadata: dict, title: str | None) -> Document | Skipped:
    """The document of `blocks` (its text: theirs, joined), or why there is none."""
    text = text_of(blocks)
    if not text.strip():
        return Skipped(source, "empty")
    structured = tuple(blocks) if is_structured(blocks) else ()
    return Document(doc_id, source, text, {**metadata, **({"title": title} if title else {})}, structured)


def _modified(path: Path) -> str:
    """The file's modification time, ISO 8601 in UTC to the second (compares as text in time order)."""
    return datetime.fromtimestamp(path.stat().st_mtime, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def html_title(html: str) -> str | None:
    """An HTML page's <title>, else its first <h1>."""
    from bs4 import BeautifulSoup

    soup = BeautifulSoup(html, "html.parser")
    for tag in (soup.title, soup.find("h1")):
        if tag is not None and (title := " ".join(tag.get_text(" ").split())):
            return title[:300]
    return None


def _too_large(size: int, limit: int) -> str:
    return f"{size:,} bytes of text, over the {limit:,}-byte limit for one document (--max-doc-bytes)"


def _read_jsonl(path: Path, text: str, max_document_bytes: int, where: dict) -> Iterator[Document | Skipped]:
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        line_at = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            yield Skipped(line_at, f"not JSON ({exc.msg})")
            continue
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            yield Skipped(line_at, 'no "text" string field')
            continue
        doc_id = record.get("id")
        if isinstance(doc_id, bool) or not isinstance(doc_id, (str, int)) or not 0 < len(str(doc_id)) <= 1024:
            yield Skipped(line_at, 'no "id" field (a string of 1 to 1024 characters, or an integer)')
            continue
        body = normalise(record["text"])
        if not body:
            yield Skipped(line_at, "empty text")
            continue
        try:
            size = len(body.encode("utf-8"))
        except UnicodeEncodeError:  # a "\\ud800" escape: no tokenizer takes it
            yield Skipped(line_at, "text is not valid Unicode (a lone surrogate escape)")
            continue
        if size > max_document_bytes:
            yield Skipped(line_at, _too_large(size, max_document_bytes))
            continue
        metadata = {k: v for k, v in record.items() if k not in ("id", "text")}
        yield Document(str(doc_id), line_at, body, {"format": "jsonl", **where, **metadata})


def normalise(text: str) -> str:
    """Unix newlines, no trailing spaces, at most one blank line in a row, stripped."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = re.sub(r"[ \t]+\n", "\n", text)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip()
