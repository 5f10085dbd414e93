"""Metadata filters (ragkv.core.filters): the grammar and its one-line errors, documents' metadata
(path, title, modified, a jsonl record's fields) kept current without re-chunking, filters
applied inside the vector search so top-k stays top-k (IVF segments too), and the same
filters from the CLI, the service and the LangChain/LlamaIndex adapters."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import ragkv
from ragkv.core.errors import InputError
from ragkv.core.filters import Filter, parse_filter
from ragkv.store import StoreWriter, open_snapshot
from ragkv.store.index import build
from tests.conftest import build_store, run_cli
from tests.test_segments import add_docs, unit

DOCS = {
    "runbooks/deploy.md": "# Deploys\n\nProduction deploys go out as canaries to 10% of traffic first.",
    "runbooks/rollback.md": "# Rollback\n\nRoll back a bad deploy with the previous release tag.",
    "handbook/leave.md": "# Leave\n\nAnnual leave is 25 days. Your manager approves leave requests.",
    "notes.jsonl": '{"id": "n2023", "text": "The 2023 deploy freeze ran in December.", "year": 2023}\n'
    '{"id": "n2025", "text": "The 2025 deploy freeze runs from 20 December.", "year": 2025}\n'
    '{"id": "n2026", "text": "In 2026 deploys pause for the migration week.", "year": 2026, "team": "infra"}\n',
}


@pytest.fixture(scope="module")
def filtered_store(tmp_path_factory, tiny_llama):
    root = tmp_path_factory.mktemp("filters")
    for name, text in DOCS.items():
        (root / "docs" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "docs" / name).write_text(text)
    build_store(root / "docs", root / "store", str(tiny_llama))
    return root / "store"


@pytest.mark.parametrize(
    "text, expected",
    [
        ("path=runbooks/*", Filter("path", "=", "runbooks/*")),
        (" year >= 2025 ", Filter("year", ">=", "2025")),
        ("modified<2026-01-01", Filter("modified", "<", "2026-01-01")),
        ("title!='Leave'", Filter("title", "!=", "Leave")),
    ],
)
def test_the_grammar_reads_field_operator_value(text, expected):
    assert parse_filter(text) == expected


@pytest.mark.parametrize("text", ["year>>2025", "year", "=2025", "year=", "a b=1", "year>=2025<2026"])
def test_a_malformed_filter_is_one_line_naming_the_grammar(text):
    with pytest.raises(InputError, match="FIELD OP VALUE") as error:
        parse_filter(text)
    assert "\n" not in str(error.value)


def test_filters_narrow_search_and_ask_and_top_k_stays_top_k(filtered_store):
    with ragkv.open(filtered_store) as engine:
        runbooks = engine.search("deploy", top_k=2, filters=["path=runbooks/*"])
        assert len(runbooks) == 2 and {r.doc_id for r in runbooks} == {"runbooks/deploy.md", "runbooks/rollback.md"}
        recent = engine.search("deploy freeze", top_k=5, filters=["year>=2025"])
        assert {r.doc_id for r in recent} == {"n2025", "n2026"}
        both = engine.search("deploy", top_k=5, filters=["year>=2025", "team=infra"])
        assert [r.doc_id for r in both] == ["n2026"]
        assert {r.doc_id for r in engine.search("deploy", top_k=9, filters=["year!=2025"])} == {"n2023", "n2026"}
        assert [r.doc_id for r in engine.search("leave", top_k=5, filters=["title=Leave"])] == ["handbook/leave.md"]
        titled = {r.doc_id for r in engine.search("deploy", top_k=9, filters=["title!=Leave"])}
        assert titled == {"runbooks/deploy.md", "runbooks/rollback.md"}  # jsonl records have no title: never match
        assert len(engine.search("deploy", top_k=9, filters=["modified>=2000-01-01"])) == 6
        lexical = engine.search("deploy", top_k=5, retrieval="hybrid", filters=["format=jsonl"])
        assert {r.doc_id for r in lexical} == {"n2023", "n2025", "n2026"}
        answer = engine.ask("When is the deploy freeze?", top_k=2, filters=["year>=2025"], max_new_tokens=2)
        assert {s.doc_id for s in answer.sources} == {"n2025", "n2026"}
        with pytest.raises(InputError, match="unknown filter field 'colour'.*year"):
            engine.search("deploy", filters=["colour=red"])


def test_an_ivf_segment_under_a_filter_still_returns_the_true_top_k(tmp_path, monkeypatch):
    monkeypatch.setattr(build, "IVF_MIN", 2000)
    rng = np.random.default_rng(3)
    with StoreWriter(tmp_path / "s") as writer:
        stored = add_docs(writer, [f"d{i:04d}" for i in range(300)], rng)  # 3000 chunks: one IVF segment
    ids = np.array(list(stored))
    allowed = rng.choice(ids, 15, replace=False)
    query = unit(rng, 1)[0]
    with open_snapshot(tmp_path / "s") as snap:
        assert snap.vectors.segments[0].kind == "ivfpq"
        found = [h.chunk_id for h in snap.vectors.search(query, 10, allowed.tolist())]
    exact = allowed[np.argsort(-np.stack([stored[i] for i in allowed]) @ query)][:10]
    assert found == exact.tolist()


def test_cli_filters_are_checked_before_any_model_loads(filtered_store, tmp_path):
    malformed = run_cli("search", "deploy", "--store", tmp_path / "nowhere", "--filter", "year>>2025")
    assert malformed.exit_code == 2 and "FIELD OP VALUE" in malformed.output
    assert len(malformed.output.strip().splitlines()) == 1
    unknown = run_cli("ask", "deploy", "--store", filtered_store, "--model", tmp_path / "no-model", "--filter", "x=1")
    assert unknown.exit_code == 2 and "unknown filter field 'x'" in unknown.output
    assert len(unknown.output.strip().splitlines()) == 1
    found = run_cli("search", "deploy", "--store", filtered_store, "--filter", "path=runbooks/*", "--json")
    assert found.exit_code == 0, found.output
    assert {r["doc_id"] for r in json.loads(found.output)["results"]} == {"runbooks/deploy.md", "runbooks/rollback.md"}


def test_a_touched_file_updates_its_metadata_without_rechunking(tmp_path, tiny_llama):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("# Alpha\n\nThe alpha service restarts nightly.")
    build_store(docs, tmp_path / "store", str(tiny_llama))
    with open_snapshot(tmp_path / "store") as snap:
        before = snap.catalog.documents.metadata_of(["a.md"])["a.md"]
        chunks = snap.catalog.documents.chunk_ids()
    os.utime(docs / "a.md", (1_900_000_000, 1_900_000_000))  # 2030
    report = build_store(docs, tmp_path / "store", str(tiny_llama))
    assert report.documents["unchanged"] == 1 and report.chunks_embedded == 0
    with open_snapshot(tmp_path / "store") as snap:
        after = snap.catalog.documents.metadata_of(["a.md"])["a.md"]
        assert after["modified"] == "2030-03-17T17:46:40Z" != before["modified"] and after["title"] == "Alpha"
        assert snap.catalog.documents.chunk_ids() == chunks


def test_the_service_and_the_adapters_take_the_same_filters(filtered_store):
    from fastapi.testclient import TestClient
    from llama_index.core.vector_stores.types import FilterCondition, MetadataFilter, MetadataFilters

    from ragkv.integrations.langchain import RagkvRetriever
    from ragkv.integrations.llama_index import RagkvNodeRetriever
    from ragkv.serve.api import ServeSettings
    from ragkv.serve.service import build_app

    with ragkv.open(filtered_store) as engine:
        with TestClient(build_app(engine, ServeSettings())) as client:
            reply = client.post("/v1/retrieve", json={"query": "deploy", "top_k": 5, "filters": ["year>=2025"]})
            assert reply.status_code == 200 and {r["doc_id"] for r in reply.json()["data"]} == {"n2025", "n2026"}
            bad = client.post("/v1/retrieve", json={"query": "deploy", "filters": ["colour=red"]})
            assert bad.status_code == 400 and "unknown filter field" in bad.json()["error"]["message"]
        chain = RagkvRetriever(engine=engine, top_k=5, context="chunk", filter={"year": {"$gte": 2025}})
        assert {d.metadata["ragkv"]["doc_id"] for d in chain.invoke("deploy")} == {"n2025", "n2026"}
        narrowed = chain.invoke("deploy", filter={"team": "infra"})
        assert [d.metadata["ragkv"]["doc_id"] for d in narrowed] == ["n2026"]
        either = chain.invoke("deploy", filter={"$or": [{"year": 2023}, {"year": 2025}]})
        assert {d.metadata["ragkv"]["doc_id"] for d in either} == {"n2025"}  # and the chain's year>=2025
        with pytest.raises(InputError, match=r"\$or"):
            chain.invoke("deploy", filter={"$or": [{"year": 2023, "team": "infra"}, {"year": 2025}]})
        where = MetadataFilters(filters=[MetadataFilter(key="path", value="runbooks/*")])
        nodes = RagkvNodeRetriever(engine, top_k=5, context="chunk", filters=where).retrieve("deploy")
        assert {n.node.metadata["ragkv"]["doc_id"] for n in nodes} == {"runbooks/deploy.md", "runbooks/rollback.md"}
        either = MetadataFilters(
            filters=[*where.filters, MetadataFilter(key="team", value="infra")], condition=FilterCondition.OR
        )
        nodes = RagkvNodeRetriever(engine, top_k=5, context="chunk", filters=either).retrieve("deploy")
        assert {n.node.metadata["ragkv"]["doc_id"] for n in nodes} == {
            "runbooks/deploy.md",
            "runbooks/rollback.md",
            "n2026",
        }
        nested = MetadataFilters(filters=[MetadataFilters(filters=where.filters * 2)], condition=FilterCondition.OR)
        with pytest.raises(InputError, match="or"):
            RagkvNodeRetriever(engine, filters=nested)
