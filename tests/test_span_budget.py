"""Spans under a KV budget: a span's KV is a path (chunk i's entry is usable only after the
entries before it), so the budget keeps each span a prefix of itself, and a question that needs
more of a span than the store holds loads what is there, computes the rest in one forward after
it and writes it back. Real (tiny) models, float32, against full prefills and against ingest."""

from __future__ import annotations

import pytest
import torch

import ragkv
from ragkv.core.config import AskSettings
from ragkv.kv import codec
from ragkv.store import open_snapshot, verify
from ragkv.store.gc import drop_dead, maintaining
from tests.conftest import build_store, run_cli
from tests.test_spans import QUESTION, SPAN_TOKENS, _assert_exact, _rows, write_doc

SPAN = AskSettings(context="span", doc_ids=("incidents.md",))


@pytest.fixture()
def stores(tiny_llama, tmp_path):
    """A span store with every chunk's KV, and one of the same documents with none (--precompute 0)."""
    docs = write_doc(tmp_path / "docs")
    full, lazy = tmp_path / "full", tmp_path / "lazy"
    build_store(docs, full, str(tiny_llama), chunk_tokens=24, span_tokens=SPAN_TOKENS)
    report = build_store(docs, lazy, str(tiny_llama), chunk_tokens=24, span_tokens=SPAN_TOKENS, precompute=0)
    assert report.kv_computed == 0 and report.kv_deferred == len(_rows(full))
    return full, lazy


def _entries(store) -> dict[int, tuple[str, torch.Tensor]]:
    """chunk_index of incidents.md -> (key, KV) of every chunk whose KV the store holds."""
    with open_snapshot(store) as snapshot:
        return {
            r.chunk_index: (r.entry.kv_key, codec.read(snapshot.shards, r.entry, torch.float32, "cpu").kv)
            for r in _rows(store)
            if r.doc_id == "incidents.md" and r.entry is not None
        }


def _stored_prefixes(store) -> dict[int, list[int]]:
    """span_start -> chunk indexes whose KV is stored, checking each span keeps a prefix."""
    rows = [r for r in _rows(store) if r.doc_id == "incidents.md"]
    assert all(r.span_start is not None and r.token_ids for r in rows)  # every chunk stays linked into its span
    found = {}
    for start in sorted({r.span_start for r in rows}):
        span = [r for r in rows if r.span_start == start]
        stored = [r.chunk_index for r in span if r.entry is not None]
        assert stored == [r.chunk_index for r in span][: len(stored)], f"span {start} keeps {stored}: not a prefix"
        found[start] = stored
    return found


def test_a_span_miss_is_computed_exactly_and_learnt_as_ingest_would_store_it(stores):
    full, lazy = stores
    with open_snapshot(lazy) as snapshot:
        assert verify(snapshot).ok  # a span's chunk linked without KV is not damage
    with ragkv.open(lazy, device="cpu", ram_bytes=0) as engine:
        answer = _assert_exact(engine, QUESTION, SPAN)
        assert answer.stats.kv_source == "computed" and len(answer.sources) >= 2
        engine.flush()
        assert engine.refresh()
        again = engine.ask(QUESTION, AskSettings(context="span", doc_ids=("incidents.md",), max_new_tokens=20))
        assert again.stats.kv_source == "store" and again.token_ids == answer.token_ids
    learnt, ingested = _entries(lazy), _entries(full)
    assert sorted(learnt) == sorted(s.chunk_index for s in answer.sources)
    for index, (key, kv_tensor) in learnt.items():
        assert key == ingested[index][0]
        torch.testing.assert_close(kv_tensor, ingested[index][1], rtol=1e-5, atol=1e-5)
    with open_snapshot(lazy) as snapshot:
        assert verify(snapshot).ok


def test_a_span_whose_tail_was_evicted_loads_its_prefix_and_computes_the_rest(stores):
    full, _ = stores
    with ragkv.open(full, device="cpu") as engine:
        ((hit, _),) = engine.retrieve(QUESTION, top_k=1, doc_ids=["incidents.md"])
    assert hit.chunk_index > hit.span_start  # the hit continues its span
    with maintaining(full) as writer:  # evict the hit's entry, the span's last one asked for
        writer.catalog.entries.evict(writer.catalog.entries.profiles()[0].profile_id, [hit.entry.kv_key])
        drop_dead(writer)
        writer.publish()
    assert hit.chunk_index not in _entries(full)
    with ragkv.open(full, device="cpu", ram_bytes=0, write_back=False) as engine:
        answer = _assert_exact(engine, QUESTION, SPAN)
        sources = {s.chunk_index: answer.stats.kv_sources[s.chunk_id] for s in answer.sources}
        assert sources == {i: "computed" if i == hit.chunk_index else "store" for i in sources}


def test_a_budget_keeps_every_span_a_prefix_and_answers_stay_exact(stores, tiny_llama, tmp_path):
    full, _ = stores
    with open_snapshot(full) as snapshot:
        prefix = snapshot.catalog.reports.prefix_bytes()
        chunk_bytes = snapshot.catalog.reports.kv_bytes() - prefix
    limit = prefix + chunk_bytes // 2
    store = tmp_path / "budget"
    docs = write_doc(tmp_path / "docs")
    report = build_store(docs, store, str(tiny_llama), chunk_tokens=24, span_tokens=SPAN_TOKENS, kv_budget=limit)
    assert report.kv_bytes <= limit and report.kv_computed > 0 and report.kv_deferred > 0
    _stored_prefixes(store)
    with ragkv.open(store, device="cpu") as engine:
        for _ in range(2):  # the second time round the learnt KV competes for its place
            _assert_exact(engine, QUESTION, SPAN)
            engine.flush()
            engine.refresh()
        assert engine.snapshot.catalog.reports.kv_bytes() <= limit
    kept = _stored_prefixes(store)
    # a smaller budget evicts tails: what stays of each span is still a prefix of it
    result = run_cli("budget", prefix + chunk_bytes // 4, "--store", store, "--json")
    assert result.exit_code == 0, result.output
    after = _stored_prefixes(store)
    assert sum(map(len, after.values())) < sum(map(len, kept.values()))
    with open_snapshot(store) as snapshot:
        assert verify(snapshot).ok
    with ragkv.open(store, device="cpu", write_back=False) as engine:
        _assert_exact(engine, QUESTION, SPAN)
