"""PDF, Word (.docx) and PowerPoint (.pptx) files as blocks with their places (ragkv.pipelines.reading.blocks),
and the metadata they hold (title, author, dates, pages).

- PDF (pypdf): each page's text runs with their font sizes; a line set larger than the body
  text (the size most characters have) is a heading, its level by its size among the heading
  sizes (the largest: 1); lines close together form a paragraph; a table's rows are lines. A
  page without a text layer gives nothing; a PDF of no text is skipped ("OCR it first").
- Word (python-docx): paragraphs and tables in document order; "Title" and "Heading N"
  paragraph styles are headings; a table row is one block, its cells joined by " | ". Word
  files have no fixed pages.
- PowerPoint (python-pptx): each slide's title is a heading on that slide (its page), then its
  text frames and table rows.

Unreadable files are skipped with their reason, as for text files: a damaged or truncated file,
a password, a Word or PowerPoint file that is not one (a zip of something else), and one that
unpacks to more than UNPACKED_LIMIT times `--max-doc-bytes` (a zip bomb).
"""

from __future__ import annotations

import statistics
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from ragkv.pipelines.reading.blocks import Block

DOCUMENT_SUFFIXES = {".pdf", ".docx", ".pptx"}
UNPACKED_LIMIT = 8  # a .docx/.pptx may unpack to this many times --max-doc-bytes, no more
HEADING_RATIO = 1.15  # a PDF line this much larger than the body text is a heading
MAX_HEADING_CHARS = 150  # ... when it is no longer than this
PARAGRAPH_GAP = 1.5  # a vertical gap this many times the usual line spacing starts a new paragraph


class Unreadable(Exception):
    """A file that cannot be read as a document; its message is the skip reason."""


@dataclass
class Read:
    blocks: list[Block]
    metadata: dict = field(default_factory=dict)  # title, author, created, modified (ISO 8601), pages


def read_document(path: Path, max_document_bytes: int) -> Read:
    """The blocks and metadata of a PDF, Word or PowerPoint file; Unreadable with the reason."""
    readers: dict[str, Callable[[Path, int], Read]] = {".pdf": read_pdf, ".docx": read_docx, ".pptx": read_pptx}
    try:
        return readers[path.suffix.lower()](path, max_document_bytes)
    except Unreadable:
        raise
    except RecursionError:
        raise Unreadable("damaged: its object tree loops") from None
    except Exception as exc:  # each library reports a damaged file its own way
        raise Unreadable(f"damaged or not a {path.suffix.lower().lstrip('.').upper()} file ({_reason(exc)})") from None


def _reason(exc: Exception) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"[:160] if text else type(exc).__name__


# -- PDF ----------------------------------------------------------------------------------------
COLUMN_GAP = 1.5  # runs on one line further apart than this many font sizes are table cells
_CHAR_WIDTH = 0.5  # a character's width, roughly, in font sizes (where a run ends)


@dataclass
class _Line:
    cells: list[str]
    size: float
    y: float
    page: int
    end: float = 0.0  # where its last run ends, roughly (x)

    @property
    def text(self) -> str:
        return " | ".join(c.strip() for c in self.cells if c.strip()) if self.is_row else "".join(self.cells)

    @property
    def is_row(self) -> bool:
        """A table row: runs far apart on one line."""
        return sum(bool(c.strip()) for c in self.cells) > 1


def read_pdf(path: Path, max_document_bytes: int) -> Read:
    import pypdf

    reader = pypdf.PdfReader(str(path), strict=False)
    if reader.is_encrypted and not reader.decrypt(""):
        raise Unreadable("password-protected: remove the password first")
    lines = []
    for number, page in enumerate(reader.pages, start=1):
        lines += _page_lines(page, number)
        if sum(len(line.text) for line in lines) > max_document_bytes:
            raise Unreadable(f"more than {max_document_bytes:,} bytes of text (--max-doc-bytes)")
    if not any(line.text.strip() for line in lines):
        raise Unreadable("no text layer (a scan?): OCR it first")
    info: dict = dict(reader.metadata or {})
    metadata = {
        "title": _text(info.get("/Title")),
        "author": _text(info.get("/Author")),
        "created": _pdf_date(info.get("/CreationDate")),
        "pages": len(reader.pages),
    }
    return Read(_pdf_blocks(lines), {k: v for k, v in metadata.items() if v})


def _page_lines(page, number: int) -> list[_Line]:
    """The page's text lines, in content order, each with its largest font size."""
    runs: list[tuple[str, float, float, float]] = []

    def visit(text, cm, tm, font, size) -> None:
        if text:
            scale = (abs(tm[0] * tm[3]) * abs(cm[0] * cm[3])) ** 0.5 or 1.0
            x = float(tm[4]) * (cm[0] or 1.0) + float(cm[4])
            runs.append((text, float(size) * scale, x, float(tm[5]) * (cm[3] or 1.0) + float(cm[5])))

    page.extract_text(visitor_text=visit)
    lines: list[_Line] = []
    for text, size, x, y in runs:
        for k, part in enumerate(text.split("\n")):
            same_line = k == 0 and lines and abs(lines[-1].y - y) < 0.5 * max(size, 1.0)
            if same_line:
                line = lines[-1]
                if part.strip() and x - line.end > COLUMN_GAP * max(size, 1.0) and line.text.strip():
                    line.cells.append(part)  # a column further on: a table cell
                else:
                    line.cells[-1] += part
                line.size = max(line.size, size if part.strip() else 0.0)
                line.end = x + _CHAR_WIDTH * size * len(part)
            elif part or k == 0:
                lines.append(
                    _Line([part], size if part.strip() else 0.0, y, number, x + _CHAR_WIDTH * size * len(part))
                )
    return [line for line in lines if line.text.strip()]


def _pdf_blocks(lines: list[_Line]) -> list[Block]:
    chars: dict[float, int] = {}
    for line in lines:
        chars[round(line.size, 1)] = chars.get(round(line.size, 1), 0) + len(line.text)
    body = max(chars, key=lambda s: chars[s])
    heading_sizes = sorted({round(ln.size, 1) for ln in lines if _is_heading(ln, body)}, reverse=True)
    gaps = [a.y - b.y for a, b in zip(lines, lines[1:], strict=False) if a.page == b.page and a.y > b.y]
    spacing = statistics.median(gaps) if gaps else 0.0
    blocks: list[Block] = []
    paragraph: list[_Line] = []

    def close() -> None:
        if paragraph:
            blocks.append(Block(" ".join(ln.text.strip() for ln in paragraph), page=paragraph[0].page))
            paragraph.clear()

    previous = None
    for line in lines:
        if _is_heading(line, body):
            close()
            level = min(heading_sizes.index(round(line.size, 1)) + 1, 6)
            blocks.append(Block(line.text.strip(), level, line.page, title=line.text.strip()))
        elif line.is_row:
            close()
            blocks.append(Block(line.text, page=line.page))
        else:
            far = (
                previous is None or previous.page != line.page or not 0 < previous.y - line.y <= PARAGRAPH_GAP * spacing
            )
            if far or previous is None or round(line.size, 1) != round(previous.size, 1):
                close()
            paragraph.append(line)
        previous = line
    close()
    return blocks


def _is_heading(line: _Line, body: float) -> bool:
    return line.size >= HEADING_RATIO * body and len(line.text.strip()) <= MAX_HEADING_CHARS and not line.is_row


def _text(value) -> str:
    return " ".join(str(value).split()) if value else ""


def _pdf_date(value) -> str:
    """A PDF date (D:YYYYMMDDHHmmSS...) as ISO 8601, or "" when it is not one."""
    text = str(value or "").removeprefix("D:")
    try:
        return datetime.strptime(text[:14], "%Y%m%d%H%M%S").replace(tzinfo=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    except ValueError:
        return ""


# -- Word and PowerPoint ------------------------------------------------------------------------
def _check_package(path: Path, required: str, kind: str, max_document_bytes: int) -> None:
    """A Word or PowerPoint file is a zip holding `required`, unpacking to a sane size."""
    try:
        with zipfile.ZipFile(path) as package:
            members = package.infolist()
    except zipfile.BadZipFile:
        raise Unreadable(f"not a {kind} file (not a zip package)") from None
    if required not in {m.filename for m in members}:
        raise Unreadable(f"not a {kind} file (no {required} inside)")
    unpacked = sum(m.file_size for m in members)
    if unpacked > UNPACKED_LIMIT * max_document_bytes:
        raise Unreadable(f"unpacks to {unpacked:,} bytes, over {UNPACKED_LIMIT} x --max-doc-bytes (a zip bomb?)")


def _core_metadata(properties, **counts: int) -> dict:
    """An Office file's own title, author and dates (ISO 8601), and `counts` (pages, slides)."""
    metadata = {
        "title": _text(properties.title),
        "author": _text(properties.author),
        "created": _iso(properties.created),
        "modified_in_file": _iso(properties.modified),
        **counts,
    }
    return {k: v for k, v in metadata.items() if v}


def _iso(value) -> str:
    if not isinstance(value, datetime):
        return ""
    stamp = value if value.tzinfo else value.replace(tzinfo=timezone.utc)
    return stamp.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def read_docx(path: Path, max_document_bytes: int) -> Read:
    import docx
    from docx.table import Table
    from docx.text.paragraph import Paragraph

    _check_package(path, "word/document.xml", "Word", max_document_bytes)
    document = docx.Document(str(path))
    blocks = []
    for element in document.element.body.iterchildren():
        tag = element.tag.rsplit("}", 1)[-1]
        if tag == "p":
            paragraph = Paragraph(element, document)
            text = paragraph.text.strip()
            if text:
                level = _docx_level(paragraph.style.name if paragraph.style else "")
                blocks.append(Block(text, level, title=text if level else ""))
        elif tag == "tbl":
            for row in Table(element, document).rows:
                cells = list(dict.fromkeys(" ".join(c.text.split()) for c in row.cells))  # merged cells repeat
                if text := " | ".join(c for c in cells if c):
                    blocks.append(Block(text))
    if not blocks:
        raise Unreadable("no text")
    return Read(blocks, _core_metadata(document.core_properties))


def _docx_level(style: str) -> int:
    """A paragraph style's heading level: "Title" above "Heading 1" (a document's title holds its
    sections), "Heading N" below it; 0 for body text."""
    if style == "Title":
        return 1
    if style.startswith("Heading ") and style[8:].isdigit():
        return min(int(style[8:]) + 1, 6)
    return 0


def read_pptx(path: Path, max_document_bytes: int) -> Read:
    import pptx

    _check_package(path, "ppt/presentation.xml", "PowerPoint", max_document_bytes)
    presentation = pptx.Presentation(str(path))
    blocks = []
    for number, slide in enumerate(presentation.slides, start=1):
        title_shape = slide.shapes.title
        title_id = title_shape.shape_id if title_shape is not None else None
        if title_shape is not None and (title := " ".join(title_shape.text_frame.text.split())):
            blocks.append(Block(title, 1, number, title=title))
        for shape in slide.shapes:
            if shape.shape_id == title_id:
                continue
            if shape.has_text_frame and (text := shape.text_frame.text.strip()):
                blocks.append(Block(text, page=number))
            elif getattr(shape, "has_table", False):
                for row in shape.table.rows:
                    if text := " | ".join(" ".join(c.text.split()) for c in row.cells if c.text.strip()):
                        blocks.append(Block(text, page=number))
    if not blocks:
        raise Unreadable("no text on any slide")
    return Read(blocks, _core_metadata(presentation.core_properties, slides=len(presentation.slides)))
