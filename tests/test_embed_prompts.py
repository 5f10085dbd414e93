"""Embedders with their query and document prompts (ragkv.model.embed): questions through
encode_query, chunks through encode_document, the prompts recorded in the store and part of its
embedding space; stores written before keep plain encode."""

from __future__ import annotations

import numpy as np
import pytest

import ragkv
from ragkv.core.config import DEFAULT_EMBEDDER, IngestSettings, ModelSettings
from ragkv.model.embed import Embedder, resolve_embedder_path
from ragkv.store import StoreWriter, open_snapshot
from tests.conftest import run_cli

DOCS = {
    "a.md": "# Alpha\n\nThe alpha service restarts nightly at two.",
    "b.md": "# Beta\n\nBeta holds the billing records for seven years.",
    "c.md": "# Gamma\n\nGamma pages the on-call engineer when queues back up.",
}
QUESTION = "How long are billing records kept?"


@pytest.fixture(scope="module")
def prompted(tmp_path_factory) -> str:
    """The bundled MiniLM saved with declared prompts (e5's), which change its vectors."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(resolve_embedder_path(DEFAULT_EMBEDDER), device="cpu")
    model.prompts = {"query": "query: ", "document": "passage: "}
    folder = tmp_path_factory.mktemp("embedder") / "prompted-minilm"
    model.save(str(folder))
    return str(folder)


def _ingest(docs, store, llm, embedder, **prompts):
    settings = ModelSettings(model=str(llm), embedder=embedder, device="cpu", dtype="float32", **prompts)
    return ragkv.ingest([docs], store, model=settings, settings=IngestSettings())


def _stored(store) -> tuple[list[str], np.ndarray]:
    with open_snapshot(store) as snapshot:
        ids, vectors = snapshot.vectors.live_vectors()
        texts = snapshot.catalog.documents.chunk_texts(ids.tolist())
    return [texts[i] for i in ids.tolist()], vectors


@pytest.fixture()
def docs(tmp_path):
    for name, text in DOCS.items():
        (tmp_path / "docs" / name).parent.mkdir(exist_ok=True)
        (tmp_path / "docs" / name).write_text(text)
    return tmp_path / "docs"


def test_both_sides_get_the_prompts_the_embedder_declares(prompted, docs, tmp_path, tiny_llama):
    from sentence_transformers import SentenceTransformer

    _ingest(docs, tmp_path / "store", tiny_llama, prompted)
    reference = SentenceTransformer(prompted, device="cpu")
    texts, vectors = _stored(tmp_path / "store")
    expected = reference.encode_document(texts, normalize_embeddings=True)
    assert np.allclose(vectors, expected, atol=1e-5)
    assert not np.allclose(vectors, reference.encode(texts, normalize_embeddings=True), atol=1e-3)  # they matter
    with ragkv.open(tmp_path / "store") as engine:
        asked = engine.embedder.embed_queries([QUESTION])
        assert np.allclose(asked, reference.encode_query([QUESTION], normalize_embeddings=True), atol=1e-5)
        assert engine.search(QUESTION, 1).hits[0].doc_id == "b.md"
    said = run_cli("stats", "--store", tmp_path / "store").output
    assert "embedding prompts: query 'query: ', document 'passage: '" in said


def test_a_changed_prompt_re_embeds_every_chunk_and_never_mixes_spaces(prompted, docs, tmp_path, tiny_llama):
    from sentence_transformers import SentenceTransformer

    store = tmp_path / "store"
    _ingest(docs, store, tiny_llama, prompted)
    again = _ingest(docs, store, tiny_llama, prompted)
    assert again.chunks_embedded == 0  # the store's prompts, unchanged: nothing to embed
    changed = _ingest(docs, store, tiny_llama, prompted, document_prompt="search_document: ")
    assert changed.chunks_embedded == len(DOCS)
    texts, vectors = _stored(store)
    reference = SentenceTransformer(prompted, device="cpu")
    assert np.allclose(
        vectors, reference.encode(["search_document: " + t for t in texts], normalize_embeddings=True), atol=1e-5
    )
    with ragkv.open(store) as engine:
        assert engine.embedder.prompts.document == "search_document: " and engine.embedder.prompts.query == "query: "
    with pytest.raises(ragkv.ModelError, match="built with embedder"):
        _ingest(docs, store, tiny_llama, DEFAULT_EMBEDDER)  # another model: refused, not mixed


def test_a_store_written_before_prompts_keeps_plain_encode(prompted, docs, tmp_path, tiny_llama):
    """A store whose catalog records no prompts (as every store written before them): questions
    and chunks stay embedded plainly, whatever the embedder declares, until asked otherwise."""
    from sentence_transformers import SentenceTransformer

    store = tmp_path / "store"
    _ingest(docs, store, tiny_llama, prompted)
    reference = SentenceTransformer(prompted, device="cpu")
    with StoreWriter(store) as writer:  # back to what an older ragkv wrote
        embedder = Embedder.load(prompted, "cpu")
        ids = sorted(writer.catalog.documents.chunk_ids())
        texts = writer.catalog.documents.chunk_texts(ids)
        fresh = writer.fresh_vectors(embedder.dim)
        fresh.add(ids, reference.encode([texts[i] for i in ids], normalize_embeddings=True))
        writer.catalog.set_meta({"embedder_prompts": "", "embedder_fingerprint": embedder.weights_fingerprint})
        writer.publish()
    with ragkv.open(store) as engine:
        assert engine.embedder.prompts.legacy
        assert np.allclose(
            engine.embedder.embed_queries([QUESTION]),
            reference.encode([QUESTION], normalize_embeddings=True),
            atol=1e-5,
        )
    assert "none recorded" in run_cli("stats", "--store", store).output
    assert _ingest(docs, store, tiny_llama, prompted).chunks_embedded == 0  # it stays as it was
    moved = _ingest(docs, store, tiny_llama, prompted, query_prompt="query: ", document_prompt="passage: ")
    assert moved.chunks_embedded == len(DOCS)
    texts, vectors = _stored(store)
    assert np.allclose(vectors, reference.encode_document(texts, normalize_embeddings=True), atol=1e-5)


def test_a_question_embedded_again_skips_the_encoder_and_gets_the_same_vector(monkeypatch):
    embedder = Embedder.load(DEFAULT_EMBEDDER, "cpu")
    calls = []
    encode = Embedder._encode

    def counting(self, side, prompt, texts, batch_size):
        calls.append(list(texts))
        return encode(self, side, prompt, texts, batch_size)

    monkeypatch.setattr(Embedder, "_encode", counting)
    first = embedder.embed_queries(["when are salaries paid?"])
    again = embedder.embed_queries(["when are salaries paid?"])
    other = embedder.embed_queries(["who approves leave?"])
    assert calls == [["when are salaries paid?"], ["who approves leave?"]]
    assert np.array_equal(first, again) and not np.array_equal(first, other)
    with pytest.raises(ValueError):  # shared by every caller: nobody may change it
        again[0, 0] = 1.0
    both = embedder.embed_queries(["when are salaries paid?", "who approves leave?"])  # several: encoded as they are
    assert calls[-1] == ["when are salaries paid?", "who approves leave?"] and both.shape == (2, first.shape[1])
