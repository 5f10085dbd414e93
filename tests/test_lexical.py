"""The lexical index (ragkv.store.index.lexical) and hybrid retrieval (ragkv.retrieval.search): BM25 over the store's
segments equals bm25s over the live corpus; it follows generations (tombstones, merges, an
older store's segments given one by the next writer); a damaged file is named by verify,
rebuilt by repair, and answered around with dense retrieval meanwhile; a question with no
words falls back to dense and says so."""

from __future__ import annotations

import json
import shutil

import bm25s
import numpy as np
import pytest
import Stemmer

import ragkv
from ragkv.retrieval.search import fuse
from ragkv.store import Hit, StoreWriter, collect_garbage, open_snapshot, verify
from ragkv.store.catalog import ChunkRow, DocumentRow
from ragkv.store.index.lexical import Postings, bm25, query_terms
from tests.conftest import QUESTIONS, run_cli

WORDS = "key rotate vault admin leave manager salary paid deploy canary traffic replica lag failover".split()


def write_docs(writer: StoreWriter, texts: dict[str, list[str]], rng) -> dict[int, str]:
    """Documents of the given chunk texts, with random vectors; returns {chunk id: text}."""
    catalog = writer.catalog
    next_id = catalog.documents.next_chunk_id()
    chunks: list[ChunkRow] = []
    for doc, parts in texts.items():
        for i, text in enumerate(parts):
            chunks.append(ChunkRow(next_id + len(chunks), doc, i, text))
    docs = [DocumentRow(d, d, f"h-{d}-{next_id}", "t", len(p)) for d, p in texts.items()]
    catalog.documents.add_documents(docs, [{}] * len(docs), chunks)
    vectors = rng.standard_normal((len(chunks), 8)).astype(np.float32)
    writer.ensure_vectors(8).add([c.chunk_id for c in chunks], vectors / np.linalg.norm(vectors, axis=1)[:, None])
    return {c.chunk_id: c.text for c in chunks}


def random_texts(rng, n: int) -> list[str]:
    return [" ".join(rng.choice(WORDS, size=rng.integers(3, 12))) for _ in range(n)]


def test_bm25_over_segments_equals_bm25s_over_the_live_corpus(tmp_path):
    rng = np.random.default_rng(0)
    root = tmp_path / "s"
    live: dict[int, str] = {}
    for round_ in range(3):  # three writers: three segments
        with StoreWriter(root) as writer:
            live.update(write_docs(writer, {f"d{round_}-{i}": random_texts(rng, 4) for i in range(5)}, rng))
    with StoreWriter(root) as writer:  # one document goes: its chunks become tombstones
        for chunk_id in writer.catalog.documents.delete_documents(["d1-2"]):
            writer.vectors.remove([chunk_id])
            live.pop(chunk_id)
    with open_snapshot(root) as snap:
        assert len(snap.vectors.segments) == 3 and len(snap.vectors.gone) == 4
        ids = sorted(live)
        reference = bm25s.BM25(method="lucene")
        stemmer = Stemmer.Stemmer("english")
        reference.index(
            bm25s.tokenize([live[i] for i in ids], stopwords="en_plus", stemmer=stemmer, show_progress=False),
            show_progress=False,
        )
        for question in ("rotate the key in the vault", "who approves leave", "canary deploys and replica lag"):
            terms = query_terms(question)
            expected = reference.get_scores(terms)
            found = {h.chunk_id: h.score for h in snap.vectors.search_terms(terms, len(ids))}
            assert set(found) == {i for i, score in zip(ids, expected, strict=True) if score > 0}
            for chunk_id, score in zip(ids, expected, strict=True):
                assert found.get(chunk_id, 0.0) == pytest.approx(float(score), abs=1e-5)
        assert verify(snap).ok


def test_postings_join_equals_postings_built_whole():
    texts = ["Rotate the API key every 90 days.", "The vault keeps keys.", "数据库管理 and replicas", "lag lag lag"]
    whole = Postings.of_texts([1, 2, 3, 4], texts)
    first, second = (
        Postings.of_texts([1, 2, 9], [texts[0], texts[1], "dropped words"]),
        Postings.of_texts([3, 4], texts[2:]),
    )
    joined = Postings.joined([(first, np.array([True, True, False])), (second, np.array([True, True]))])
    assert joined.terms == whole.terms and "dropped" not in joined.terms
    for name in ("chunk_ids", "lengths", "indptr", "rows", "tfs"):
        assert np.array_equal(getattr(joined, name), getattr(whole, name)), name


def test_cjk_text_is_searched_by_character_pairs_and_a_question_of_stop_words_has_no_terms():
    assert query_terms("数据库管理") == ["数据", "据库", "库管", "管理"]
    postings = Postings.of_texts([7, 8], ["数据库的备份每天进行", "Salaries are paid monthly."])
    found = bm25([(postings, np.ones(2, bool))], query_terms("数据库备份"), 5)
    assert [h.chunk_id for h in found] == [7]
    assert query_terms("What is the?") == [] and query_terms("🙂 🙂") == []


def test_fusion_weighs_the_two_lists_by_their_scaled_scores():
    dense = [Hit(1, 0.9), Hit(2, 0.8), Hit(3, 0.1)]
    lexical = [Hit(3, 12.0), Hit(4, 6.0), Hit(2, 0.0)]
    assert [h.chunk_id for h in fuse(dense, lexical, 0.0)][:3] == [1, 2, 3]  # dense alone
    assert [h.chunk_id for h in fuse(dense, lexical, 1.0)][:2] == [3, 4]  # lexical alone
    mixed = {h.chunk_id: h.score for h in fuse(dense, lexical, 0.5)}
    assert mixed[1] == pytest.approx(0.5) and mixed[3] == pytest.approx(0.5) and mixed[2] == pytest.approx(0.4375)


def test_a_store_written_before_the_lexical_index_falls_back_until_a_writer_builds_it(tmp_path, tiny_store):
    store = tmp_path / "old"
    shutil.copytree(tiny_store, store)
    with open_snapshot(store) as snap:
        generation = snap.generation
    manifest_file = store / f"manifest-{generation:06d}.json"
    manifest = json.loads(manifest_file.read_text())
    for segment in manifest["segments"]:  # as an older ragkv wrote it: no lexical files
        segment.pop("terms")
        segment.pop("terms_nbytes")
    manifest_file.write_text(json.dumps(manifest))
    with ragkv.open(store) as engine:
        found = engine.search("LumenGuest password", top_k=2, retrieval="hybrid")
        assert found.retrieval == "dense" and "does not cover" in found.warnings[0]
        assert [r.chunk_id for r in found] == [r.chunk_id for r in engine.search("LumenGuest password", top_k=2)]
    with open_snapshot(store) as snap:
        assert verify(snap).ok and any("lexical index does not cover" in w for w in verify(snap).warnings)
    collect_garbage(store)  # any writer builds it (once), from the chunks' texts
    with ragkv.open(store) as engine:
        found = engine.search("LumenGuest password", top_k=2, retrieval="lexical")
        assert found.retrieval == "lexical" and not found.warnings
        assert "LumenGuest" in found[0].text


def test_a_damaged_lexical_file_is_answered_around_named_by_verify_and_rebuilt_by_repair(tmp_path, tiny_store):
    store = tmp_path / "damaged"
    shutil.copytree(tiny_store, store)
    terms = next((store / "segments").glob("terms-*"))
    terms.write_bytes(terms.read_bytes()[:40])
    searched = run_cli("search", QUESTIONS[2], "--store", store, "--retrieval", "hybrid", "--json", "--top-k", "2")
    assert searched.exit_code == 0, searched.output
    reply = json.loads(searched.output)
    assert terms.name in reply["warnings"][0] and "dense retrieval only" in reply["warnings"][0]
    dense = json.loads(run_cli("search", QUESTIONS[2], "--store", store, "--json", "--top-k", "2").output)
    assert [r["chunk_id"] for r in reply["results"]] == [r["chunk_id"] for r in dense["results"]]
    checked = run_cli("verify", "--store", store)
    assert checked.exit_code == 4 and "lexical" in checked.output and terms.name in checked.output
    repaired = run_cli("verify", "--repair", "--store", store)
    assert repaired.exit_code == 0 and "1 lexical files rebuilt" in repaired.output, repaired.output
    assert run_cli("verify", "--store", store).exit_code == 0
    again = json.loads(run_cli("search", QUESTIONS[2], "--store", store, "--retrieval", "hybrid", "--json").output)
    assert "warnings" not in again


def test_lexical_and_hybrid_search_and_ask(tiny_store):
    with ragkv.open(tiny_store) as engine:
        lexical = engine.search("LumenGuest", top_k=3, retrieval="lexical")
        assert lexical.retrieval == "lexical" and len(lexical) == 1 and "LumenGuest" in lexical[0].text
        hybrid = engine.search("What is the LumenGuest network password?", top_k=3, retrieval="hybrid")
        assert hybrid.retrieval == "hybrid" and "LumenGuest" in hybrid[0].text and len(hybrid) == 3
        answer = engine.ask("LumenGuest", top_k=1, retrieval="lexical", max_new_tokens=3)
        assert answer.sources[0].chunk_id == lexical[0].chunk_id
        dense = engine.ask(QUESTIONS[0], top_k=2, retrieval="dense", rerank=0, max_new_tokens=3)
        assert [s.chunk_id for s in dense.sources] == [r.chunk_id for r, _ in engine.retrieve(QUESTIONS[0], top_k=2)]


@pytest.mark.parametrize("question", ["What is the?", "🙂🙂🙂"])
def test_a_question_without_words_falls_back_to_dense_and_says_so(tiny_store, question):
    with ragkv.open(tiny_store) as engine:
        found = engine.search(question, top_k=2, retrieval="hybrid")
        assert found.retrieval == "dense" and "no words" in found.warnings[0]
        assert [r.chunk_id for r in found] == [r.chunk_id for r in engine.search(question, top_k=2)]
        answer = engine.ask(question, top_k=1, retrieval="lexical", max_new_tokens=2)
        assert any("no words" in w for w in answer.stats.warnings)
