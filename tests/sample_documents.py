"""Writes the sample corpus's PDF and Word files (data/engineering/security-handbook.pdf,
data/handbook/hardware-policy.docx) with fpdf2 and python-docx, so that their text stays
reviewable here. Run it from the repository root after editing the text:

    python tests/sample_documents.py
"""

from __future__ import annotations

from pathlib import Path

DATA = Path(__file__).resolve().parent.parent / "data"

SECURITY = [  # (level, text): 1 and 2 are headings, 0 body text; "PAGE" starts a new page
    (1, "Access"),
    (
        0,
        "Every employee signs in with Okta and a hardware key. Shared accounts are not allowed; "
        "a service that needs one gets a service account owned by a team.",
    ),
    (2, "Production access"),
    (
        0,
        "Production access is granted for eight hours at a time through the access portal. "
        "Ask in #access-requests with the ticket number; the on-call engineer approves it.",
    ),
    ("PAGE", ""),
    (1, "Secrets"),
    (0, "Secrets live in the vault, never in the repository or in chat. The vault logs every read."),
    (2, "Rotating keys"),
    (
        0,
        "API keys are rotated every 90 days. Create the new key in the admin console, store it in "
        "the vault under beacon/api-key, deploy, and revoke the old key after ten minutes of clean "
        "traffic. A key that leaked is revoked at once, before the new one is deployed.",
    ),
    (2, "Certificates"),
    (
        0,
        "TLS certificates renew automatically 30 days before they expire; the certificate "
        "dashboard turns red 14 days before expiry if a renewal failed.",
    ),
    ("PAGE", ""),
    (1, "Laptops"),
    (
        0,
        "Laptops use full-disk encryption and lock after five minutes. Report a lost laptop to "
        "security@lumenlabs.example within one hour; it is wiped remotely.",
    ),
]

HARDWARE = [  # (level, text) for the Word file; "TABLE" rows follow
    (0, "Hardware policy"),
    (1, "Laptops"),
    (None, "Every employee gets a laptop on day one: a 14-inch MacBook Pro, or a ThinkPad X1 on request."),
    (2, "Replacement"),
    (None, "Laptops are replaced every four years, or earlier when a repair costs more than half a new one."),
    (1, "Phones"),
    (None, "On-call engineers get a company phone; others may claim 20 euros a month for their own."),
    (1, "Returning equipment"),
    (None, "Return every device on your last day; IT sends a prepaid box to remote employees."),
]
HARDWARE_TABLE = [("Device", "Budget"), ("Laptop", "2,800 euros"), ("Monitor", "400 euros"), ("Headset", "150 euros")]


def security_pdf(path: Path) -> None:
    from fpdf import FPDF

    pdf = FPDF()
    pdf.set_title("Security handbook")
    pdf.set_author("Lumen Labs Security")
    pdf.add_page()
    for level, text in SECURITY:
        if level == "PAGE":
            pdf.add_page()
            continue
        size, style, height = {1: (18, "B", 10), 2: (14, "B", 8), 0: (11, "", 6)}[level]
        pdf.set_font("Helvetica", style, size)
        pdf.multi_cell(0, height, text, new_x="LMARGIN", new_y="NEXT")
    pdf.output(str(path))


def hardware_docx(path: Path) -> None:
    import docx

    document = docx.Document()
    document.core_properties.title = "Hardware policy"
    document.core_properties.author = "Lumen Labs IT"
    for level, text in HARDWARE:
        if level is None:
            document.add_paragraph(text)
        else:
            document.add_heading(text, level=level)
    table = document.add_table(rows=len(HARDWARE_TABLE), cols=2)
    for row, cells in zip(table.rows, HARDWARE_TABLE, strict=True):
        row.cells[0].text, row.cells[1].text = cells
    document.save(str(path))


if __name__ == "__main__":
    security_pdf(DATA / "engineering" / "security-handbook.pdf")
    hardware_docx(DATA / "handbook" / "hardware-policy.docx")
