"""Question -> relevant-document sets for measuring retrieval, built from text these machines
carry (fetched at run time, never committed; the sample corpus's set is committed, since it is
ours):

- "python-faq": the Python FAQ (Debian's python3.11-doc). Every FAQ entry becomes one document
  holding its answer only; its question heading is the question. The heading is left out of the
  document, or retrieval would be matching the question against itself.
- "debian-faq": the Debian FAQ (Debian's debian-faq), built the same way.
- "sample": questions written for the sample corpus in data/ (benchmarks/retrieval_sample.jsonl),
  each naming the documents that answer it; the corpus is data/ itself.

Each set is (corpus folder, [Question]). A question is answered when a retrieved chunk belongs
to one of its relevant documents.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SAMPLE_SET = ROOT / "benchmarks" / "retrieval_sample.jsonl"
PACKAGES = {  # set -> (Debian package, its FAQ's HTML folder inside the package, its pages)
    "python-faq": ("python3.11-doc", "usr/share/doc/python3.11/html/faq", "*.html"),
    "debian-faq": ("debian-faq", "usr/share/doc/debian/FAQ", "*.en.html"),  # each page is there twice
}


@dataclass(frozen=True)
class Question:
    qid: str
    question: str
    relevant: tuple[str, ...]  # doc ids that answer it


def build(name: str, work: Path) -> tuple[Path, list[Question]] | None:
    """Set `name`'s corpus (a folder to ingest) and questions; None when its package cannot be
    fetched here."""
    if name == "sample":
        return ROOT / "data", sample_questions()
    package, folder, pages = PACKAGES[name]
    html = _fetch(work, package, folder)
    if html is None:
        return None
    return faq_corpus(sorted(html.glob(pages)), work / f"{name}-corpus", name)


def sample_questions() -> list[Question]:
    questions = []
    for line in SAMPLE_SET.read_text().splitlines():
        record = json.loads(line)
        questions.append(Question(record["id"], record["question"], tuple(record["relevant"])))
    return questions


def split(questions: list[Question], seed: int = 0) -> tuple[list[Question], list[Question]]:
    """(dev, test): a fixed random half each. Weights are chosen on dev, reported on test."""
    shuffled = questions[:]
    random.Random(seed).shuffle(shuffled)
    half = len(shuffled) // 2
    return shuffled[:half], shuffled[half:]


def _fetch(work: Path, package: str, folder: str) -> Path | None:
    target = work / package
    html = target / folder
    if html.is_dir():
        return html
    target.mkdir(parents=True, exist_ok=True)
    fetched = subprocess.run(["apt-get", "download", package], cwd=work, capture_output=True)
    debs = sorted(work.glob(f"{package}_*.deb"))
    if fetched.returncode or not debs:
        print(f"{package} unavailable here; its set is skipped", file=sys.stderr)
        return None
    subprocess.run(["dpkg-deb", "-x", str(debs[-1]), str(target)], check=True)
    return html


def faq_corpus(pages: list[Path], out: Path, name: str) -> tuple[Path, list[Question]]:
    """Every FAQ entry (a heading that asks a question, and the text of its section without the
    sections inside it) as a document of `out/faq.jsonl`; the headings as the questions."""
    from bs4 import BeautifulSoup

    out.mkdir(parents=True, exist_ok=True)
    records, questions = [], []
    for page in pages:
        if page.name.startswith("index"):
            continue
        soup = BeautifulSoup(page.read_text(encoding="utf-8"), "html.parser")
        for heading in soup.find_all(["h2", "h3", "h4"]):
            question = _clean(heading.get_text(" ")).replace("¶", "").strip()
            question = re.sub(r"^[\d.]+\s+", "", question)  # the Debian FAQ numbers its entries
            if not question.endswith("?"):
                continue
            answer = _answer_text(heading)
            if len(answer.split()) < 8:
                continue
            doc_id = f"{name}-{len(records)}"
            records.append({"id": doc_id, "text": answer, "page": page.name})
            questions.append(Question(doc_id, question, (doc_id,)))
    (out / "faq.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return out, questions


def _answer_text(heading) -> str:
    """The text of the section `heading` titles, without its title and without the sections
    nested inside it (their own entries)."""
    section = heading.find_parent(["section"]) or heading.find_parent("div", class_="section")
    if section is None:
        return ""
    parts = []
    for node in section.find_all(string=True):
        inner = node.find_parent(["section"]) or node.find_parent("div", class_="section")
        if inner is not section or node.find_parent(["h1", "h2", "h3", "h4"]) is not None:
            continue
        parts.append(str(node))
    return _clean(" ".join(parts))


def _clean(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()
