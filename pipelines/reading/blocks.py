"""A document's structure: its text as blocks (paragraphs, headings, table rows), each with its
place: the heading it opens (its level), and the page or slide it is on. Readers produce them
(ragkv.pipelines.reading.read for text formats, ragkv.pipelines.reading.documents for PDF, Word and PowerPoint); the
chunker keeps sections whole by them (ragkv.pipelines.reading.chunk); each chunk's section path and pages
are what an answer cites.

A document's text is its blocks joined by blank lines, so a Markdown or reStructuredText file
reads as the same text it always did (its heading marks kept): the blocks only say where the
sections are.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

_MD_HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")
_UNDERLINE = re.compile(r"^([=\-~^\"'`#*+])\1{2,}\s*$")


@dataclass(frozen=True)
class Block:
    """One paragraph-like piece of a document, in reading order."""

    text: str
    level: int = 0  # a heading's level (1: the outermost); 0: body text
    page: int | None = None  # 1-based page (PDF) or slide (PowerPoint); None: the format has none
    title: str = ""  # a heading's own words (its text less marks such as "#")
    joiner: str = "\n\n"  # what separates it from the block before ("\n": the same paragraph)


def text_of(blocks: Sequence[Block]) -> str:
    """The document's text: its blocks, each after its joiner (a blank line, as a rule)."""
    return "".join((b.joiner if i else "") + b.text for i, b in enumerate(b for b in blocks if b.text))


def paths(blocks: Sequence[Block]) -> list[tuple[str, ...]]:
    """Each block's section path: the titles of the headings it is under, outermost first (a
    heading's own path ends with its title)."""
    open_headings: list[tuple[int, str]] = []
    found = []
    for block in blocks:
        if block.level:
            open_headings = [(lv, t) for lv, t in open_headings if lv < block.level] + [(block.level, block.title)]
        found.append(tuple(t for _, t in open_headings))
    return found


def markdown_blocks(text: str) -> list[Block]:
    """Paragraphs of a Markdown text; `#` lines and setext (underlined) headings as headings
    (not inside ``` fences, where `#` starts a comment)."""
    blocks = []
    in_fence = False
    for paragraph in _paragraphs(text):
        lines = paragraph.split("\n")
        fenced = in_fence
        in_fence ^= sum(line.lstrip().startswith("```") for line in lines) % 2 == 1
        if fenced or lines[0].lstrip().startswith("```"):
            blocks.append(Block(paragraph))
            continue
        if found := _MD_HEADING.match(lines[0]):
            blocks.append(Block(lines[0], len(found[1]), title=found[2]))
            if rest := "\n".join(lines[1:]).strip("\n"):
                blocks.append(Block(rest, joiner="\n"))
            continue
        if len(lines) >= 2 and _UNDERLINE.match(lines[1]) and lines[1].strip()[0] in "=-":
            level = 1 if lines[1].strip()[0] == "=" else 2
            blocks.append(Block("\n".join(lines[:2]), level, title=lines[0].strip()))
            if rest := "\n".join(lines[2:]).strip("\n"):
                blocks.append(Block(rest, joiner="\n"))
            continue
        blocks.append(Block(paragraph))
    return blocks


def rst_blocks(text: str) -> list[Block]:
    """Paragraphs of a reStructuredText text; a title underlined (or over- and underlined) is a
    heading, its level by the order its underline character first appears (RST's own rule)."""
    order: list[str] = []
    blocks = []
    for paragraph in _paragraphs(text):
        lines = paragraph.split("\n")
        over = len(lines) >= 3 and _UNDERLINE.match(lines[0]) and _UNDERLINE.match(lines[2])
        title_at = 1 if over else 0
        if len(lines) > title_at + 1 and _UNDERLINE.match(lines[title_at + 1]) and lines[title_at].strip():
            mark = lines[title_at + 1].strip()[0] + ("o" if over else "")
            if mark not in order:
                order.append(mark)
            head = "\n".join(lines[: title_at + 2])
            blocks.append(Block(head, order.index(mark) + 1, title=lines[title_at].strip()))
            if rest := "\n".join(lines[title_at + 2 :]).strip("\n"):
                blocks.append(Block(rest, joiner="\n"))
            continue
        blocks.append(Block(paragraph))
    return blocks


def plain_blocks(text: str) -> list[Block]:
    return [Block(p) for p in _paragraphs(text)]


def _paragraphs(text: str) -> list[str]:
    return [p.strip("\n") for p in re.split(r"\n\s*\n", text) if p.strip()]


_HTML_BLOCKS = ["p", "li", "h1", "h2", "h3", "h4", "h5", "h6", "pre", "tr", "dt", "dd", "blockquote", "figcaption"]
_HTML_DROPPED = ["script", "style", "noscript", "template", "head", "nav", "footer", "aside", "form"]


def html_blocks(html: str) -> list[Block]:
    """The visible blocks of an HTML page: headings (h1-h6), paragraphs, list items and table
    rows (cells joined by " | "); scripts, styles, navigation, footers, asides and forms
    dropped. A page with none of those block elements is one block of its text."""
    from bs4 import BeautifulSoup

    soup = BeautifulSoup(html, "html.parser")
    for tag in soup(_HTML_DROPPED):
        tag.decompose()
    found = [b for b in soup.find_all(_HTML_BLOCKS) if not b.find(_HTML_BLOCKS)]
    if not found:
        text = " ".join(soup.get_text(" ").split())
        return [Block(text)] if text else []
    blocks = []
    for element in found:
        if element.name == "tr":
            cells = [" ".join(c.get_text(" ").split()) for c in element.find_all(["td", "th"])]
            text = " | ".join(c for c in cells if c)
        else:
            text = " ".join(element.get_text(" ").split())
        if not text:
            continue
        level = int(element.name[1]) if re.fullmatch(r"h[1-6]", element.name) else 0
        blocks.append(Block(text, level, title=text if level else ""))
    return blocks
