"""`ragkv eval` on question sets no setting of ragkv was ever chosen on, and what a cross-encoder
rerank costs on 2 cores.

1. Held-out sets, built from Debian documentation packages fetched at run time (never committed):
   - sqlite-faq: the SQLite FAQ (sqlite3-doc's faq.html): each entry's answer a document, its
     question the question;
   - git-faq: the Git FAQ (git-doc's gitfaq.html), the same way.
   Each set is ingested with the defaults and measured with the default retrieval and the others,
   side by side, with 95% bootstrap intervals.
2. The cross-encoder's cost: a MiniLM-size cross-encoder (the bundled all-MiniLM-L6-v2's 6 layers
   under a one-logit head: ms-marco-MiniLM-L6-v2's shape; its scores mean nothing, its time is
   what is measured) reranks 20 candidates on the sample corpus, against the cached time to
   first token of `ragkv ask` on the same store (each question asked twice, the second timed).

    python benchmarks/eval_heldout.py [--work DIR] [--out benchmarks/results/eval_heldout.md]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.machine import describe  # noqa: E402

SETTINGS = ["hybrid", "dense", "lexical", "hybrid --rerank 10"]
PACKAGES = {
    "sqlite-faq": ("sqlite3-doc", "usr/share/doc/sqlite3/faq.html"),
    "git-faq": ("git-doc", "usr/share/doc/git-doc/gitfaq.html"),
}


def fetch(work: Path, package: str, page: str) -> Path:
    target = work / package
    if not (target / page).exists():
        subprocess.run(["apt-get", "download", package], cwd=work, check=True, capture_output=True)
        deb = sorted(work.glob(f"{package}_*.deb"))[-1]
        subprocess.run(["dpkg-deb", "-x", str(deb), str(target)], check=True)
    return target / page


def entries(name: str, page: Path) -> list[tuple[str, str]]:
    """(question, answer) of each FAQ entry."""
    from bs4 import BeautifulSoup

    soup = BeautifulSoup(page.read_text(encoding="utf-8"), "html.parser")
    found = []
    if name == "git-faq":
        for term in soup.find_all("dt", class_="hdlist1"):
            found.append((_text(term), _text(term.find_next_sibling("dd"))))
    else:
        for bold in soup.find_all("b"):
            if _text(bold).startswith("("):
                found.append((_text(bold).split(")", 1)[1].strip(), _text(bold.find_next("blockquote"))))
    return [(q, a) for q, a in found if len(a.split()) >= 8]


def _text(node) -> str:
    return " ".join(node.get_text(" ").split())


def build(name: str, work: Path) -> tuple[Path, Path, int]:
    """The set's corpus folder (one jsonl document per answer) and its questions file."""
    corpus, questions = work / f"{name}-corpus", work / f"{name}.jsonl"
    corpus.mkdir(parents=True, exist_ok=True)
    pairs = entries(name, fetch(work, *PACKAGES[name]))
    records = [{"id": f"{name}-{i}", "text": answer} for i, (_, answer) in enumerate(pairs)]
    (corpus / "faq.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    lines = [{"question": q, "doc_ids": [f"{name}-{i}"]} for i, (q, _) in enumerate(pairs)]
    questions.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return corpus, questions, len(pairs)


def ragkv(*args: str) -> str:
    return subprocess.run(
        [sys.executable, "-m", "ragkv", *args], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout


def cross_encoder(folder: Path) -> Path:
    """The bundled MiniLM's encoder under a random one-logit head, as a CrossEncoder folder."""
    from transformers import AutoTokenizer, BertForSequenceClassification

    from ragkv.model.embed import resolve_embedder_path

    source = resolve_embedder_path("all-MiniLM-L6-v2")
    BertForSequenceClassification.from_pretrained(source, num_labels=1).save_pretrained(folder)
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    return folder


def cached_ttft_ms(store: Path, questions: list[str]) -> list[float]:
    """`ask`'s time to first token from the store's KV, each question's second asking (one engine)."""
    import ragkv as library

    with library.open(store, device="cpu") as engine:
        return [[engine.ask(q, max_new_tokens=1).stats.ttft_s for _ in range(2)][1] * 1000.0 for q in questions]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "eval_heldout.md")
    args = parser.parse_args()
    sections = [
        "# `ragkv eval` on held-out sets, and the cross-encoder's cost",
        "",
        f"`python benchmarks/eval_heldout.py`, {time.strftime('%Y-%m-%d')}. Machine: {describe()}. Stores built "
        "with the defaults (bundled SmolLM2-135M and all-MiniLM-L6-v2). No setting of ragkv was chosen on these sets.",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for name in PACKAGES:
            corpus, questions, count = build(name, work)
            store = work / f"{name}-store"
            ragkv("ingest", str(corpus), "--store", str(store), "--quiet")
            table = ragkv("eval", str(questions), *SETTINGS, "--store", str(store))
            sections += ["", f"## {name}: {count} questions ({PACKAGES[name][0]})", "", "```", table.rstrip(), "```"]
        sample = work / "sample-store"
        ragkv("ingest", str(ROOT / "data"), "--store", str(sample), "--quiet")
        folder = cross_encoder(work / "minilm-cross-encoder")
        setting = f"hybrid --rerank 20 --reranker {folder}"
        report = json.loads(
            ragkv(
                "eval", str(ROOT / "benchmarks" / "retrieval_sample.jsonl"), setting, "--store", str(sample), "--json"
            )
        )
        crossed = report["settings"][0]["latency_ms"]["cross_encoder"]
        questions = [
            json.loads(line)["question"]
            for line in (ROOT / "benchmarks" / "retrieval_sample.jsonl").read_text().splitlines()
        ][:12]
        ttft = float(np.median(cached_ttft_ms(sample, questions)))
        sections += [
            "",
            "## A cross-encoder rerank of 20 candidates, against a cached time to first token",
            "",
            f"A MiniLM-size cross-encoder (6 layers, 384 wide: ms-marco-MiniLM-L6-v2's shape) scoring 20 candidates "
            f"per question, on the sample corpus's {report['questions']} questions: p50 {crossed['p50']:.0f} ms, p90 "
            f"{crossed['p90']:.0f} ms. `ragkv ask`'s cached time to first token on the same store (12 questions, each "
            f"asked twice, the second timed): median {ttft:.0f} ms. The rerank costs {crossed['p50'] / ttft:.2f} cached "
            "TTFTs at the median.",
            "",
        ]
    args.out.write_text("\n".join(sections))
    print(args.out.read_text())


if __name__ == "__main__":
    main()
