"""Reading documents in every format, reporting unusable files, and chunking within limits."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from ragkv.core.errors import InputError
from ragkv.model.prompt import encode_text
from ragkv.pipelines.reading.chunk import chunk_text
from ragkv.pipelines.reading.read import read_documents


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return AutoTokenizer.from_pretrained(tiny_llama)


def test_every_format_is_read_with_stable_ids(corpus):
    result = read_documents([corpus])
    by_id = {d.doc_id: d for d in result.documents}
    assert sorted(by_id) == ["db.rst", "keys.md", "leave.txt", "page.html", "payroll", "wifi"]
    assert result.skipped == []
    html = by_id["page.html"].text
    assert "canaries" in html and "<p>" not in html and "var a" not in html
    payroll = by_id["payroll"].metadata
    expected = {"format": "jsonl", "team": "people", "path": "faq.jsonl"}
    assert {k: payroll[k] for k in ("format", "team", "path")} == expected
    assert by_id["keys.md"].metadata["path"] == "keys.md" and by_id["keys.md"].metadata["modified"].startswith("20")
    titles = {doc_id: by_id[doc_id].metadata.get("title") for doc_id in ("keys.md", "db.rst", "page.html", "leave.txt")}
    assert titles == {"keys.md": "API keys", "db.rst": "Database failover", "page.html": "x", "leave.txt": None}
    assert by_id["payroll"].source.endswith("faq.jsonl:2")
    assert read_documents([corpus / "keys.md"]).documents[0].doc_id == "keys.md"


def test_unusable_files_are_listed_with_a_reason(tmp_path):
    (tmp_path / "ok.md").write_text("Fine.")
    (tmp_path / "empty.txt").write_text("  \n\n ")
    (tmp_path / "blob.txt").write_bytes(b"\x00\x01\x02binary")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "image.png").write_bytes(b"\x89PNG")
    (tmp_path / "bad.jsonl").write_text(
        '{"id": 1, "text": "one"}\nnot json\n{"text": "no id"}\n{"id": 1, "text": "dup"}\n'
    )
    (tmp_path / ".hidden.md").write_text("hidden files are not documents")
    result = read_documents([tmp_path])
    assert sorted(d.doc_id for d in result.documents) == ["1", "ok.md"]
    reasons = {s.source.rsplit("/", 1)[-1]: s.reason for s in result.skipped}
    assert reasons["empty.txt"] == "empty"
    assert reasons["blob.txt"] == "binary file"
    assert reasons["latin1.txt"].startswith("not valid UTF-8")
    assert reasons["image.png"].startswith("unsupported file type .png")
    assert reasons["bad.jsonl:2"].startswith("not JSON")
    assert reasons["bad.jsonl:3"] == 'no "id" field (a string of 1 to 1024 characters, or an integer)'
    assert reasons["bad.jsonl:4"] == "duplicate document id '1'"


def test_a_missing_path_is_an_error_before_anything_is_read(tmp_path):
    with pytest.raises(InputError, match="does-not-exist does not exist"):
        read_documents([tmp_path, tmp_path / "does-not-exist"])


def test_chunks_respect_the_token_limit_and_keep_all_text(tokenizer):
    paragraphs = [" ".join(f"Sentence {p}.{s} says something about topic {p}." for s in range(12)) for p in range(6)]
    text = "\n\n".join(paragraphs)
    chunks = chunk_text(text, tokenizer, max_tokens=64)
    assert len(chunks) > 6
    assert all(len(encode_text(tokenizer, c)) <= 64 for c in chunks)
    assert " ".join(" ".join(chunks).split()) == " ".join(text.split())


def test_paragraphs_that_fit_stay_whole(tokenizer):
    text = "First paragraph is short.\n\nSecond one too.\n\nThird."
    assert chunk_text(text, tokenizer, max_tokens=512) == [text]
    assert chunk_text(text, tokenizer, max_tokens=8) == ["First paragraph is short.", "Second one too.\n\nThird."]


def test_a_document_longer_than_the_context_is_chunked(tokenizer):
    run_on = "word " * 5000 + "end"  # one sentence, no boundaries, far beyond a 1024-token context
    chunks = chunk_text(run_on, tokenizer, max_tokens=200)
    assert all(len(encode_text(tokenizer, c)) <= 200 for c in chunks)
    assert sum(c.count("word") for c in chunks) == 5000 and chunks[-1].endswith("end")
