"""Real documents: how fast each format and library reads, whether chunks keep sections whole,
and what reading a PDF adds to an ingest.

1. Reading speed: a generated PDF of PAGES pages (headings, paragraphs, a table per page) read
   by pypdf as ragkv reads it (text runs with font sizes), by pdfplumber (`extract_text`) and
   by pdfminer.six (`extract_text`); a Word file and a PowerPoint deck of as many sections and
   slides, by python-docx and python-pptx as ragkv reads them. Pages (sections, slides) per
   second, median of REPEATS.
2. Chunk quality on the sample corpus's documents with headings (and the generated ones):
   top-level sections that fit in --chunk-tokens but end up split between chunks, chunked as
   plain text (`chunk_text`, before) and by sections (`chunk_blocks`, after), at 128, 256 and
   512 tokens.
3. Ingest time of the generated PDF against the same text given as a .txt file (the bundled
   SmolLM2, float32; fresh stores, best of 2): what reading the PDF adds.

    python benchmarks/documents.py [--pages 40]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.machine import describe  # noqa: E402
from ragkv.model.prompt import encode_text  # noqa: E402
from ragkv.pipelines.reading.blocks import Block  # noqa: E402
from ragkv.pipelines.reading.chunk import chunk_blocks, chunk_text  # noqa: E402
from ragkv.pipelines.reading.documents import read_docx, read_pdf, read_pptx  # noqa: E402
from ragkv.pipelines.reading.read import read_documents  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "documents.md"
REPEATS = 3
SENTENCES = [
    "The service keeps a replica in a second region and fails over within a minute.",
    "Every change is reviewed by a second engineer before it is deployed to production.",
    "Alerts page the on-call engineer, who acknowledges within five minutes.",
    "Backups are taken nightly and a restore is rehearsed every month.",
]


def write_long_pdf(path: Path, pages: int) -> None:
    from fpdf import FPDF

    pdf = FPDF()
    for page in range(pages):
        pdf.add_page()
        pdf.set_font("Helvetica", "B", 18)
        pdf.multi_cell(0, 10, f"Chapter {page + 1}", new_x="LMARGIN", new_y="NEXT")
        for part in range(2):
            pdf.set_font("Helvetica", "B", 14)
            pdf.multi_cell(0, 8, f"Section {page + 1}.{part + 1}", new_x="LMARGIN", new_y="NEXT")
            pdf.set_font("Helvetica", "", 11)
            pdf.multi_cell(0, 6, " ".join(SENTENCES * 3), new_x="LMARGIN", new_y="NEXT")
        with pdf.table() as table:
            for row in (("Service", "Owner"), (f"svc-{page}", "team"), (f"svc-{page}b", "team")):
                cells = table.row()
                for cell in row:
                    cells.cell(cell)
    pdf.output(str(path))


def write_long_docx(path: Path, sections: int) -> None:
    import docx

    document = docx.Document()
    for number in range(sections):
        document.add_heading(f"Chapter {number + 1}", level=1)
        document.add_paragraph(" ".join(SENTENCES * 3))
        document.add_heading(f"Section {number + 1}.1", level=2)
        document.add_paragraph(" ".join(SENTENCES * 3))
    document.save(str(path))


def write_long_pptx(path: Path, slides: int) -> None:
    import pptx

    deck = pptx.Presentation()
    for number in range(slides):
        slide = deck.slides.add_slide(deck.slide_layouts[1])
        slide.shapes.title.text = f"Slide {number + 1}"
        slide.placeholders[1].text = "\n".join(SENTENCES)
    deck.save(str(path))


def per_second(read, count: int) -> float:
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        read()
        times.append(time.perf_counter() - start)
    return count / statistics.median(times)


def reading_speeds(work: Path, pages: int) -> dict[str, float]:
    pdf, docx_file, pptx_file = work / "long.pdf", work / "long.docx", work / "long.pptx"
    write_long_pdf(pdf, pages)
    write_long_docx(docx_file, pages)
    write_long_pptx(pptx_file, pages)
    import pdfplumber
    from pdfminer.high_level import extract_text

    def plumber() -> None:
        with pdfplumber.open(str(pdf)) as document:
            for page in document.pages:
                page.extract_text()

    limit = 64 << 20
    return {
        "PDF, pypdf (ragkv: runs with font sizes)": per_second(lambda: read_pdf(pdf, limit), pages),
        "PDF, pdfplumber extract_text": per_second(plumber, pages),
        "PDF, pdfminer.six extract_text": per_second(lambda: extract_text(str(pdf)), pages),
        "Word, python-docx (ragkv), sections": per_second(lambda: read_docx(docx_file, limit), pages),
        "PowerPoint, python-pptx (ragkv), slides": per_second(lambda: read_pptx(pptx_file, limit), pages),
    }


def split_sections(blocks: list[Block], chunks: list[str], tokenizer, max_tokens: int) -> tuple[int, int]:
    """(sections that fit in max_tokens, of those the ones whose text is not inside one chunk).
    A section is a top-level one: under the outermost heading level at which the document
    has more than one heading."""
    levels = sorted({b.level for b in blocks if b.level})
    top = next((lv for lv in levels if sum(b.level == lv for b in blocks) > 1), None)
    if top is None:
        return 0, 0
    sections: list[list[Block]] = []
    for block in blocks:
        if block.level == top or not sections:
            sections.append([])
        sections[-1].append(block)
    fitting = split = 0
    for section in sections:
        text = "\n\n".join(b.text for b in section)
        if not any(b.level == top for b in section) or len(encode_text(tokenizer, text)) > max_tokens:
            continue
        fitting += 1
        split += not any(all(b.text in chunk for b in section) for chunk in chunks)
    return fitting, split


def chunk_quality(documents, tokenizer) -> dict[int, tuple[int, int, int]]:
    """{max tokens: (sections that fit, split before, split after)}."""
    found = {}
    for max_tokens in (128, 256, 512):
        fitting = before = after = 0
        for doc in documents:
            if not doc.blocks:
                continue
            plain = chunk_text(doc.text, tokenizer, max_tokens)
            fit, split_plain = split_sections(list(doc.blocks), plain, tokenizer, max_tokens)
            structured = [c.text for c in chunk_blocks(doc.blocks, tokenizer, max_tokens)]
            _, split_structured = split_sections(list(doc.blocks), structured, tokenizer, max_tokens)
            fitting, before, after = fitting + fit, before + split_plain, after + split_structured
        found[max_tokens] = (fitting, before, after)
    return found


def ingest_times(work: Path) -> dict[str, float]:
    import ragkv
    from ragkv.core.config import ModelSettings

    pdf = work / "long.pdf"
    (work / "as-text").mkdir(exist_ok=True)
    (work / "as-pdf").mkdir(exist_ok=True)
    text = read_documents([pdf]).documents[0].text
    (work / "as-text" / "long.txt").write_text(text)
    (work / "as-pdf" / "long.pdf").write_bytes(pdf.read_bytes())
    model = ModelSettings(device="cpu", dtype="float32")
    times: dict[str, float] = {}
    for name in ("as-text", "as-pdf", "as-text", "as-pdf"):
        store = work / f"store-{name}-{len(times)}"
        start = time.perf_counter()
        ragkv.ingest([work / name], store, model=model)
        took = time.perf_counter() - start
        times[name] = min(times.get(name, float("inf")), took)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pages", type=int, default=40)
    args = parser.parse_args()
    from ragkv.model.llm import load_model

    work = Path(tempfile.mkdtemp(prefix="ragkv-documents-"))
    speeds = reading_speeds(work, args.pages)
    tokenizer = load_model("smollm2", "cpu", "float32").tokenizer
    documents = read_documents([ROOT / "data", work / "long.pdf", work / "long.docx", work / "long.pptx"]).documents
    quality = chunk_quality(documents, tokenizer)
    ingest = ingest_times(work)
    lines = [
        "# Reading PDF, Word and PowerPoint files",
        "",
        f"Machine: {describe()}. Written by `python benchmarks/documents.py --pages {args.pages}`.",
        "",
        f"## Reading speed ({args.pages} pages, sections or slides; median of {REPEATS})",
        "",
        "| reader | per second |",
        "|---|---|",
        *[f"| {name} | {rate:.1f} |" for name, rate in speeds.items()],
        "",
        "## Top-level sections that fit in a chunk but are split",
        "",
        f"The sample corpus's {sum(bool(d.blocks) for d in documents) - 3} documents with headings, and the generated "
        "PDF, Word and PowerPoint files.",
        "",
        "| chunk tokens | sections that fit | split, chunked as plain text | split, chunked by sections |",
        "|---|---|---|---|",
        *[f"| {tokens} | {fit} | {before} | {after} |" for tokens, (fit, before, after) in quality.items()],
        "",
        "## Ingest: the PDF against the same text as .txt (bundled SmolLM2, float32, best of 2)",
        "",
        "| input | ingest (s) |",
        "|---|---|",
        f"| .txt | {ingest['as-text']:.1f} |",
        f"| .pdf | {ingest['as-pdf']:.1f} |",
        f"| PDF / text | {ingest['as-pdf'] / ingest['as-text']:.2f}x |",
        "",
        "The text's chunks differ (the PDF is chunked by its sections), so the two ingests compute",
        "about, not exactly, the same tokens; reading the PDF is what the difference adds.",
    ]
    OUT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
