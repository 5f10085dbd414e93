"""Real documents: PDF, Word and PowerPoint files read with their structure (headings, pages,
slides, table rows) and metadata; unreadable ones skipped with a reason; chunks that keep
sections whole and cite their pages and section; incremental re-ingest as for text."""

from __future__ import annotations

import json
import shutil

import pytest

import ragkv
from ragkv.model.prompt import encode_text
from ragkv.pipelines.reading.blocks import Block, markdown_blocks, paths
from ragkv.pipelines.reading.chunk import chunk_blocks
from ragkv.pipelines.reading.read import read_documents
from tests.conftest import build_store, run_cli
from tests.office import (
    write_docx,
    write_looping_pdf,
    write_pdf,
    write_pptx,
    write_scan,
    write_wrong_zip,
    write_zip_bomb,
)


@pytest.fixture(scope="module")
def office(tmp_path_factory):
    folder = tmp_path_factory.mktemp("office")
    write_pdf(folder / "manual.pdf")
    write_docx(folder / "policy.docx")
    write_pptx(folder / "deck.pptx")
    return folder


def _by_id(folder):
    found = read_documents([folder])
    return {d.doc_id: d for d in found.documents}, {s.source.rsplit("/", 1)[-1]: s.reason for s in found.skipped}


def test_a_pdf_reads_as_headings_paragraphs_and_table_rows_on_their_pages(office):
    documents, skipped = _by_id(office)
    pdf = documents["manual.pdf"]
    assert not skipped
    headings = [(b.level, b.page, b.title) for b in pdf.blocks if b.level]
    assert headings == [(1, 1, "Security"), (2, 1, "Rotating keys"), (1, 3, "Operations"), (1, 4, "Columns")]
    rows = [b.text for b in pdf.blocks if " | " in b.text]
    assert rows == ["Service | Owner | On call", "billing | Ana | yes", "search | Bo | no"]
    assert {b.page for b in pdf.blocks} == {1, 2, 3, 4}  # page 5 holds only an image: no text
    left, right = (b.text for b in pdf.blocks if "column:" in b.text)
    assert left.startswith("Left column") and right.startswith("Right column")  # two columns, in reading order
    assert "revoked after ten minutes" in next(b.text for b in pdf.blocks if b.page == 2)
    metadata = pdf.metadata
    assert (metadata["title"], metadata["author"], metadata["pages"], metadata["format"]) == (
        "Ops manual",
        "Lumen Labs",
        5,
        "pdf",
    )


def test_word_and_powerpoint_read_with_their_headings_slides_and_tables(office):
    documents, _ = _by_id(office)
    word = documents["policy.docx"]
    assert [(b.level, b.title) for b in word.blocks if b.level] == [
        (1, "Expense policy"),
        (2, "Limits"),
        (3, "Hotels"),
        (2, "Approval"),
    ]
    assert "500 or more | director" in word.text and word.metadata["author"] == "Finance"
    deck = documents["deck.pptx"]
    assert [(b.page, b.title) for b in deck.blocks if b.level] == [(1, "Incident response"), (2, "Severity levels")]
    assert [b.text for b in deck.blocks if b.page == 2 and not b.level][0] == "Level | Meaning"
    assert deck.text.count("Incident response") == 1 and deck.metadata["slides"] == 2


def test_unreadable_documents_are_skipped_with_their_reason_and_the_rest_read(tmp_path, office):
    folder = tmp_path / "bad"
    folder.mkdir()
    write_scan(folder / "scan.pdf")
    write_pdf(folder / "locked.pdf", password="secret")
    (folder / "truncated.pdf").write_bytes((office / "manual.pdf").read_bytes()[:900])
    write_looping_pdf(folder / "loop.pdf")
    write_zip_bomb(folder / "bomb.docx", 80 << 20)
    write_wrong_zip(folder / "wrong.docx")
    (folder / "fake.pptx").write_text("not a zip at all")
    shutil.copy(office / "manual.pdf", folder / "fine.pdf")
    found = read_documents([folder], max_document_bytes=8 << 20)
    reasons = {s.source.rsplit("/", 1)[-1]: s.reason for s in found.skipped}
    assert [d.doc_id for d in found.documents] == ["fine.pdf"]
    assert "OCR it first" in reasons["scan.pdf"] and "password" in reasons["locked.pdf"]
    assert "damaged" in reasons["truncated.pdf"] and "cyclic" in reasons["loop.pdf"]
    assert "zip bomb" in reasons["bomb.docx"] and "no word/document.xml" in reasons["wrong.docx"]
    assert "not a zip" in reasons["fake.pptx"]
    small = read_documents([folder / "fine.pdf"], max_document_bytes=1000)  # a long PDF over --max-doc-bytes
    assert not small.documents and "--max-doc-bytes" in small.skipped[0].reason


def test_no_chunk_splits_a_section_that_fits_and_a_short_one_joins_its_neighbour(tiny_llama):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)

    def body(i: int, n: int) -> str:
        return " ".join(f"Fact {j} of part {i} is stated here." for j in range(n))

    text = "# Guide\n\nIntro.\n\n" + "\n\n".join(f"## Part {i}\n\n{body(i, n)}" for i, n in enumerate([3, 9, 1, 40, 2]))
    blocks = markdown_blocks(text)
    chunks = chunk_blocks(blocks, tokenizer, 64)
    for i, n in enumerate([3, 9, 1, 40, 2]):
        section = f"## Part {i}\n\n{body(i, n)}"
        holding = [c for c in chunks if f"of part {i} " in c.text]
        if len(encode_text(tokenizer, section)) <= 64:
            assert len(holding) == 1 and section in holding[0].text, f"part {i} was split"
        else:
            assert len(holding) > 1 and holding[0].section[-1] == f"Part {i}"
            assert f"## Part {i}" in holding[0].text  # its heading opens its first chunk, never ends another
    assert all(len(encode_text(tokenizer, c.text)) <= 64 for c in chunks)
    assert any("## Part 2" in c.text and ("of part 1 " in c.text or "of part 3 " in c.text) for c in chunks)
    plain = [Block(p) for p in text.split("\n\n")]
    assert [c.section for c in chunk_blocks(plain, tokenizer, 64)] == [()] * len(chunk_blocks(plain, tokenizer, 64))


def test_answers_and_search_cite_page_and_section(tmp_path, tiny_llama, office):
    store = tmp_path / "store"
    report = build_store(office, store, str(tiny_llama), chunk_tokens=96)
    assert report.documents["added"] == 3 and not report.skipped
    with ragkv.open(store) as engine:
        rows = {r.chunk_id: r for r, _ in engine.retrieve("anything", top_k=1000, context="chunk")}
        expected = {
            "revoked after ten minutes": ("manual.pdf", ("Security", "Rotating keys"), 2),
            "billing | Ana | yes": ("manual.pdf", ("Operations",), 3),
            "150 euros a night": ("policy.docx", ("Expense policy",), None),  # the chunk holds the whole policy
            "SEV1 | customers down": ("deck.pptx", (), 2),  # two short slides share a chunk: no one section
        }
        for phrase, (doc_id, section, page) in expected.items():
            (row,) = [r for r in rows.values() if phrase in r.text]
            assert row.doc_id == doc_id and row.section == section, (phrase, row.section)
            assert (row.pages is None) if page is None else row.pages[0] <= page <= row.pages[1]
        documents, _ = _by_id(office)
        for doc_id in ("manual.pdf", "policy.docx", "deck.pptx"):  # every chunk's place, against its blocks
            document = documents[doc_id]
            spans, position = [], 0  # each block's [start, stop) in the document's text
            for i, block in enumerate(document.blocks):
                position += len(block.joiner) if i else 0
                spans.append((position, position + len(block.text)))
                position += len(block.text)
            cursor = 0
            for row in sorted((r for r in rows.values() if r.doc_id == doc_id), key=lambda r: r.chunk_index):
                start = document.text.find(row.text, cursor)  # chunks are the text's pieces, in order
                assert start >= 0, row.text[:60]
                cursor = start + len(row.text)
                inside = [  # the blocks it holds, whole or in part
                    (b, p)
                    for b, p, (lo, hi) in zip(document.blocks, paths(document.blocks), spans, strict=True)
                    if lo < cursor and hi > start
                ]
                assert all(p[: len(row.section)] == row.section for _, p in inside), (row.section, row.text[:60])
                assert row.pages is None or all(row.pages[0] <= b.page <= row.pages[1] for b, _ in inside)
        found = engine.search("When is the old key revoked?", top_k=20)
        hit = next(r for r in found if "revoked after ten minutes" in r.text)
        assert hit.citation.startswith("manual.pdf p. ") and "§ Security › Rotating keys" in hit.citation
        answer = engine.ask("Who is on call for billing?", top_k=1, max_new_tokens=2, doc_ids=["manual.pdf"])
        assert answer.sources[0].citation.startswith("manual.pdf p. ")
    searched = run_cli("search", "SEV1", "--store", store, "--retrieval", "lexical", "--json")
    result = json.loads(searched.output)["results"][0]
    assert result["citation"] == "deck.pptx p. 1-2" and result["pages"] == [1, 2]
    printed = run_cli("ask", "billing owner", "--store", store, "--retrieval", "lexical", "--max-new-tokens", "2")
    assert "source: " in printed.stderr and "manual.pdf" in printed.stderr and "§ Operations" in printed.stderr


def test_a_slide_that_fills_a_chunk_cites_its_slide_and_title(office, tiny_llama):
    from transformers import AutoTokenizer

    documents, _ = _by_id(office)
    chunks = chunk_blocks(documents["deck.pptx"].blocks, AutoTokenizer.from_pretrained(tiny_llama), 24)
    assert [(c.section, c.pages) for c in chunks] == [(("Incident response",), (1, 1)), (("Severity levels",), (2, 2))]


def test_an_unchanged_pdf_costs_nothing_and_a_changed_one_recomputes_only_its_changed_chunks(tmp_path, tiny_llama):
    docs = tmp_path / "docs"
    docs.mkdir()
    write_pdf(docs / "manual.pdf")
    store = tmp_path / "store"
    first = build_store(docs, store, str(tiny_llama), chunk_tokens=96)
    again = build_store(docs, store, str(tiny_llama), chunk_tokens=96)
    assert again.documents["unchanged"] == 1 and again.kv_computed == 0 and again.chunks_embedded == 0
    write_pdf(docs / "manual.pdf")  # the same text, written again: its file's dates differ, its chunks do not
    rewritten = build_store(docs, store, str(tiny_llama), chunk_tokens=96)
    assert rewritten.documents["unchanged"] == 1 and rewritten.kv_computed == 0
    write_pdf(docs / "manual.pdf", note="Every service has an owner, a runbook and an on-call flag.")
    changed = build_store(docs, store, str(tiny_llama), chunk_tokens=96)
    assert changed.documents["changed"] == 1 and changed.kv_computed == 1  # the Operations page's chunk
    assert changed.kv_reused > 0 and first.kv_computed > 1


def test_spans_keep_a_section_whole_when_it_fits(tmp_path, tiny_llama):
    docs = tmp_path / "docs"
    docs.mkdir()
    sizes = [6, 3, 6, 3, 6]
    parts = [
        f"## Part {i}\n\n" + " ".join(f"Fact {j} of part {i} is stated here." for j in range(n))
        for i, n in enumerate(sizes)
    ]
    (docs / "guide.md").write_text("# Guide\n\n" + "\n\n".join(parts))
    store = tmp_path / "store"
    build_store(docs, store, str(tiny_llama), chunk_tokens=40, span_tokens=160)
    with ragkv.open(store) as engine:
        rows = sorted(
            (r for r, _ in engine.retrieve("anything", top_k=1000, context="chunk")), key=lambda r: r.chunk_index
        )
    for i in range(len(sizes)):
        starts = {r.span_start for r in rows if f"of part {i} " in r.text and r.section[-1:] == (f"Part {i}",)}
        assert len(starts) == 1, f"part {i} is split across spans {starts}"
    assert len({r.span_start for r in rows}) > 1  # the document is several spans


def test_a_catalog_written_before_chunk_places_is_read_as_it_is_and_migrated_by_a_writer(tmp_path, tiny_store):
    import duckdb

    from ragkv.store import StoreWriter, open_snapshot

    store = tmp_path / "older"
    shutil.copytree(tiny_store, store)
    with open_snapshot(store) as snap:
        generation, base, expected = snap.generation, snap.catalog.base_name(), snap.catalog.documents.chunk_ids()
    for path, prefix in ((store / base, ""), (store / f"catalog-{generation:06d}.duckdb", "add_")):
        con = duckdb.connect(str(path))  # as a ragkv before 0004_chunk_places wrote it
        for table, column in [(f"{prefix}chunks", c) for c in ("section", "page_start", "page_end")] + [
            (f"{prefix}profiles", c)
            for c in ("kv_layout", "self_check")  # 0005, after 0004
        ]:
            con.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
        if not prefix:
            migrations = json.loads(con.execute("SELECT value FROM meta WHERE key = 'migrations'").fetchone()[0])
            before = migrations[: migrations.index("0004_chunk_places")]
            con.execute("UPDATE meta SET value = ? WHERE key = 'migrations'", [json.dumps(before)])
        con.close()
    with ragkv.open(store) as engine:  # a reader: no error, no places
        found = engine.search("When are salaries paid?", top_k=2)
        assert found[0].section == () and found[0].pages is None and found[0].citation == found[0].doc_id
    with StoreWriter(store) as writer:  # the first writer migrates (by compacting: the base is shared)
        assert writer.compacted
    with open_snapshot(store) as snap:
        assert snap.catalog.documents.chunk_ids() == expected
        assert snap.catalog.con.execute("SELECT count(*) FROM chunks WHERE section IS NULL").fetchone()[0] > 0
