"""Real PDF, Word and PowerPoint files for the tests, written with fpdf2, python-docx and
python-pptx: headings, several pages, a table, two columns, an image-only page, and the
damaged, encrypted and hostile files a reader must skip with a reason."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

LOREM = "Keys are rotated on a schedule and every rotation is logged by the security team. "


def write_pdf(
    path: Path,
    *,
    two_columns: bool = True,
    image_page: bool = True,
    password: str | None = None,
    note: str = "Every service has an owner and an on-call flag.",
) -> Path:
    """Pages: 1 "Security" (h1) with "Rotating keys" (h2) running onto page 2; 2 "Operations"
    (h1) with a table; 3 two columns ("Left column", "Right column" text); 4 an image only."""
    from fpdf import FPDF

    pdf = FPDF()
    pdf.set_title("Ops manual")
    pdf.set_author("Lumen Labs")

    def text(size: int, style: str, body: str, height: float) -> None:
        pdf.set_font("Helvetica", style, size)
        pdf.multi_cell(0, height, body, new_x="LMARGIN", new_y="NEXT")

    pdf.add_page()
    text(20, "B", "Security", 10)
    text(11, "", "This manual says how Lumen Labs keeps its systems safe.", 6)
    text(15, "B", "Rotating keys", 8)
    text(11, "", "Rotate the Beacon API key every 90 days in the admin console. " + LOREM * 60, 6)
    text(11, "", "The old key is revoked after ten minutes of clean traffic.", 6)
    pdf.add_page()
    text(20, "B", "Operations", 10)
    text(11, "", note, 6)
    pdf.set_font("Helvetica", "", 11)
    with pdf.table() as table:
        for row in (("Service", "Owner", "On call"), ("billing", "Ana", "yes"), ("search", "Bo", "no")):
            cells = table.row()
            for cell in row:
                cells.cell(cell)
    if two_columns:
        pdf.add_page()
        text(20, "B", "Columns", 10)
        pdf.set_font("Helvetica", "", 11)
        top = pdf.get_y()
        pdf.set_xy(10, top)
        pdf.multi_cell(90, 6, "Left column: backups run nightly at two. " * 4, new_x="LMARGIN", new_y="NEXT")
        pdf.set_xy(110, top)
        pdf.multi_cell(90, 6, "Right column: restores are tested monthly. " * 4, new_x="LMARGIN", new_y="NEXT")
    if image_page:
        pdf.add_page()
        pdf.set_fill_color(40, 40, 40)
        pdf.rect(20, 20, 100, 60, style="F")  # a drawing, no text: as a scanned page reads
    if password is not None:
        pdf.set_encryption(owner_password="owner", user_password=password)
    pdf.output(str(path))
    return path


def write_scan(path: Path) -> Path:
    """A PDF with pages but no text layer (what a scanner writes)."""
    from fpdf import FPDF

    pdf = FPDF()
    for _ in range(2):
        pdf.add_page()
        pdf.rect(20, 20, 150, 200, style="F")
    pdf.output(str(path))
    return path


def write_docx(path: Path) -> Path:
    """A Word file: title, two sections (Heading 1), a Heading 2, a table."""
    import docx

    document = docx.Document()
    document.core_properties.title = "Expense policy"
    document.core_properties.author = "Finance"
    document.add_heading("Expense policy", level=0)  # the "Title" style
    document.add_paragraph("Spend company money as if it were your own.")
    document.add_heading("Limits", level=1)
    document.add_paragraph("Meals are reimbursed up to 40 euros a day when travelling.")
    document.add_heading("Hotels", level=2)
    document.add_paragraph("Hotels up to 150 euros a night; book through the travel portal.")
    document.add_heading("Approval", level=1)
    table = document.add_table(rows=3, cols=2)
    for row, (amount, who) in zip(
        table.rows, [("Amount", "Approver"), ("under 500", "manager"), ("500 or more", "director")], strict=True
    ):
        row.cells[0].text, row.cells[1].text = amount, who
    document.save(str(path))
    return path


def write_pptx(path: Path) -> Path:
    """A deck: slide 1 "Incident response" with bullets, slide 2 "Severity levels" with a table."""
    import pptx
    from pptx.util import Inches

    deck = pptx.Presentation()
    deck.core_properties.title = "On-call training"
    first = deck.slides.add_slide(deck.slide_layouts[1])
    first.shapes.title.text = "Incident response"
    first.placeholders[1].text = "Page the incident commander.\nOpen a channel named after the incident."
    second = deck.slides.add_slide(deck.slide_layouts[5])
    second.shapes.title.text = "Severity levels"
    shape = second.shapes.add_table(3, 2, Inches(1), Inches(2), Inches(6), Inches(2))
    for r, (level, meaning) in enumerate([("Level", "Meaning"), ("SEV1", "customers down"), ("SEV2", "degraded")]):
        shape.table.cell(r, 0).text, shape.table.cell(r, 1).text = level, meaning
    deck.save(str(path))
    return path


def write_zip_bomb(path: Path, unpacked: int) -> Path:
    """A .docx whose document.xml unpacks to `unpacked` bytes (of zeros: it compresses ~1000x)."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as package:
        package.writestr("[Content_Types].xml", "<Types/>")
        package.writestr("word/document.xml", b"\0" * unpacked)
    return path


def write_wrong_zip(path: Path) -> Path:
    """A .docx that is a zip of something else."""
    with zipfile.ZipFile(path, "w") as package:
        package.writestr("notes.txt", "not a Word document")
    return path


def write_looping_pdf(path: Path) -> Path:
    """A PDF whose page tree points back at itself (a cycle in the object tree)."""
    body = io.BytesIO()
    body.write(b"%PDF-1.4\n")
    offsets = []
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [2 0 R] /Count 1 >>",
    ]
    for number, content in enumerate(objects, start=1):
        offsets.append(body.tell())
        body.write(f"{number} 0 obj\n".encode() + content + b"\nendobj\n")
    start = body.tell()
    body.write(f"xref\n0 {len(objects) + 1}\n0000000000 65535 f \n".encode())
    for offset in offsets:
        body.write(f"{offset:010d} 00000 n \n".encode())
    body.write(f"trailer\n<< /Size {len(objects) + 1} /Root 1 0 R >>\nstartxref\n{start}\n%%EOF\n".encode())
    path.write_bytes(body.getvalue())
    return path
