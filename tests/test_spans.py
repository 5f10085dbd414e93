"""Document-continuous KV (`ingest --span-tokens`): a document's chunks are computed as one
sequence, restarting at span boundaries, so a retrieved chunk with the chunks before it
(`--context span`) loads exactly from the store; an edit recomputes what changed and what
follows it in its span, nothing else. Real (tiny) models, float32, against full prefills."""

from __future__ import annotations

import pytest

import ragkv
from ragkv.core.config import AskSettings, IngestSettings, ModelSettings
from ragkv.core.errors import InputError
from ragkv.core.keys import KVKey, Profile
from ragkv.kv import spans
from ragkv.store import open_snapshot
from tests.conftest import build_store, flip_bit_of_entry, run_cli

PARAGRAPHS = [  # each about one 24-token chunk; spans of 64 tokens hold two or three of them
    "The incident commander opens a bridge call and names a scribe within five minutes.",
    "The scribe writes every decision into the incident document with the time it was made.",
    "Customer support posts a status page update every thirty minutes until recovery.",
    "After recovery the commander schedules a blameless review within three working days.",
    "The review lists the timeline, the root cause, and one owner for every follow-up task.",
    "Follow-up tasks get a due date and are tracked on the reliability board each Monday.",
    "Severity one incidents also page the director of engineering and the on-call manager.",
]
QUESTION = "Who gets paged for a severity one incident?"
SPAN_TOKENS = 64


def write_doc(folder, paragraphs=PARAGRAPHS):
    folder.mkdir(exist_ok=True)
    (folder / "incidents.md").write_text("\n\n".join(paragraphs))
    (folder / "other.md").write_text("Lunch is served in the canteen from noon until two.")
    return folder


@pytest.fixture()
def span_store(tiny_llama, tmp_path):
    store = tmp_path / "store"
    report = build_store(write_doc(tmp_path / "docs"), store, str(tiny_llama), chunk_tokens=24, span_tokens=SPAN_TOKENS)
    return store, report


def _rows(store):
    with open_snapshot(store) as snapshot:
        profile_id = snapshot.catalog.entries.profiles()[0].profile_id
        ids = sorted(snapshot.catalog.documents.chunk_ids())
        return sorted(snapshot.catalog.entries.context_rows(profile_id, ids), key=lambda r: (r.doc_id, r.chunk_index))


def test_ingest_chains_a_documents_chunks_into_bounded_spans(span_store):
    store, report = span_store
    rows = [r for r in _rows(store) if r.doc_id == "incidents.md"]
    assert len(rows) >= 5
    starts = sorted({r.span_start for r in rows})
    assert len(starts) >= 2 and starts[0] == 0  # restarted at least once
    for start in starts:
        span = [r for r in rows if r.span_start == start]
        assert [r.chunk_index for r in span] == list(range(start, start + len(span)))
        assert sum(r.entry.num_tokens for r in span) <= SPAN_TOKENS
    # A span's first chunk is keyed as if alone; every later key chains through all before it.
    continuing = [r for r in rows if not r.starts_span]
    assert continuing and all(r.entry.num_tokens > len(r.token_ids) for r in continuing)  # separator + chunk
    assert report.kv_computed == len(rows) + 1  # and the other document's one chunk


def _assert_exact(engine, question, settings: AskSettings, max_new_tokens=20):
    """The answer from the store equals a full prefill of the same prompt; returns it."""
    cached = engine.ask(question, AskSettings.from_dict({**_plain(settings), "max_new_tokens": max_new_tokens}))
    full = engine.ask(
        question, AskSettings.from_dict({**_plain(settings), "max_new_tokens": max_new_tokens, "use_cache": False})
    )
    assert cached.prompt_ids == full.prompt_ids
    assert cached.token_ids == full.token_ids
    logits = engine.first_token_logits(question, settings)
    reference = engine.first_token_logits(question, AskSettings.from_dict({**_plain(settings), "use_cache": False}))
    assert (logits - reference).abs().max().item() < 1e-4
    return cached


def _plain(settings: AskSettings) -> dict:
    return {"top_k": settings.top_k, "context": settings.context, "mode": settings.mode, "doc_ids": settings.doc_ids}


def test_span_context_loads_a_hit_with_the_chunks_before_it_exactly(span_store):
    store, _ = span_store
    with ragkv.open(store, device="cpu") as engine:
        ((hit, _),) = engine.retrieve(QUESTION, top_k=1, doc_ids=["incidents.md"])
        assert hit.span_start is not None
        answer = _assert_exact(engine, QUESTION, AskSettings(context="span", doc_ids=("incidents.md",)))
        indexes = [s.chunk_index for s in answer.sources]
        assert indexes == list(range(hit.span_start, hit.chunk_index + 1))
        question_tokens = len(engine.active.layout.question_ids(engine.lm.tokenizer, QUESTION))
        assert answer.stats.computed_tokens == question_tokens  # every context token came from the store
        assert answer.stats.reused_tokens == len(answer.prompt_ids) - question_tokens


def test_document_context_takes_the_whole_span_and_neighbouring_hits_merge(span_store):
    store, _ = span_store
    with ragkv.open(store, device="cpu") as engine:
        hits = engine.retrieve(QUESTION, top_k=3, doc_ids=["incidents.md"])
        answer = _assert_exact(engine, QUESTION, AskSettings(context="document", top_k=3, doc_ids=("incidents.md",)))
        spans = {h.span_start for h, _ in hits}
        rows = [r for r in _rows(store) if r.doc_id == "incidents.md" and r.span_start in spans]
        assert sorted(s.chunk_index for s in answer.sources) == sorted(r.chunk_index for r in rows)
        assert len({s.chunk_id for s in answer.sources}) == len(answer.sources)  # merged, never twice


def test_chunk_context_on_a_span_store_stays_exact_and_says_why_it_prefilled(span_store):
    store, _ = span_store
    with ragkv.open(store, device="cpu") as engine:
        target = [r for r in _rows(store) if r.doc_id == "incidents.md" and not r.starts_span][-1]
        answer = _assert_exact(engine, target.text, AskSettings(context="chunk", doc_ids=("incidents.md",)))
        assert [s.chunk_id for s in answer.sources] == [target.chunk_id]  # its own text finds it
        assert answer.stats.reused_tokens == 0
        assert any("continues a span" in w for w in answer.stats.warnings)


def test_approximate_modes_join_whole_spans(span_store):
    store, _ = span_store
    with ragkv.open(store, device="cpu") as engine:
        exact = engine.ask(QUESTION, top_k=2, max_new_tokens=4)
        blended = engine.ask(QUESTION, top_k=2, max_new_tokens=4, mode="blend", blend_ratio=1.0)
        assert blended.stats.mode == "blend" and blended.prompt_ids == exact.prompt_ids
        assert blended.token_ids == exact.token_ids  # ratio 1.0 recomputes every context token


def test_an_edit_recomputes_what_changed_and_what_follows_it_in_its_span(span_store, tiny_llama, tmp_path):
    store, _ = span_store
    before = {r.chunk_index: r for r in _rows(store) if r.doc_id == "incidents.md"}
    edited = list(PARAGRAPHS)
    edited[1] = edited[1].replace("every decision", "each decision")
    report = build_store(
        write_doc(tmp_path / "docs", edited), store, str(tiny_llama), chunk_tokens=24, span_tokens=SPAN_TOKENS
    )
    after = {r.chunk_index: r for r in _rows(store) if r.doc_id == "incidents.md"}
    assert sorted(after) == sorted(before) and after[1].text != before[1].text  # same chunking, one chunk edited
    changed = [i for i in after if after[i].entry.kv_key != before[i].entry.kv_key]
    span_of_edit = after[1].span_start
    assert changed == [i for i in after if after[i].span_start == span_of_edit and i >= 1]  # the edit and after it
    assert report.kv_computed == len(changed)
    with ragkv.open(store, device="cpu") as engine:
        _assert_exact(engine, QUESTION, AskSettings(context="span", doc_ids=("incidents.md",)))


def test_repair_recomputes_a_damaged_entry_inside_a_span(span_store):
    store, _ = span_store
    damaged = next(r for r in _rows(store) if r.doc_id == "incidents.md" and not r.starts_span)
    flip_bit_of_entry(store / "shards" / damaged.entry.shard, damaged.entry.tensor)
    result = run_cli("verify", "--store", store, "--repair", "--json")
    assert result.exit_code == 0, result.output
    with ragkv.open(store, device="cpu") as engine:
        answer = _assert_exact(engine, damaged.text, AskSettings(context="span", doc_ids=("incidents.md",)))
        assert answer.stats.mode == "exact"


def test_keys_chain_through_every_earlier_chunk():
    profile = Profile("m", "t", "p", (1, 2), "float32")
    first = KVKey.for_chunk(profile, [5, 6])
    assert first.then([9, 7]) != KVKey.for_chunk(profile, [5, 7]).then([9, 7])
    assert first.then([9, 7]) == KVKey.for_chunk(profile, [5, 6]).then([9, 7])
    assert first.then([9, 7]).then([8]) != first.then([9, 8]).then([8])


def test_a_prompt_walked_segment_by_segment_finds_the_keys_ingest_gave_its_span():
    profile, separator = Profile("m", "t", "p", (1, 2), "float32"), [0]
    chunks = [[5, 6, 7], [8, 9], [4]]
    prompt = [*chunks[0], *separator, *chunks[1], *separator, *chunks[2], 3]
    walked, key, pos = [], None, 0
    for n in (3, 3, 2):  # each segment's length: a chunk alone, then separator + chunk
        found = spans.continuations(profile, key, prompt, pos, lengths=(n, 40))  # 40 runs past the prompt
        assert len(found) == 1
        ((key, segment),) = found.values()
        walked.append(key)
        pos += len(segment)
    assert walked == spans.span_keys(profile, chunks, separator)


def test_bad_span_settings_are_one_line_errors(tmp_path, tiny_llama):
    with pytest.raises(InputError, match="--span-tokens"):
        IngestSettings(chunk_tokens=512, span_tokens=100)
    with pytest.raises(InputError, match="--context"):
        AskSettings(context="paragraph")
    result = run_cli("ask", "anything", "--store", tmp_path, "--context", "paragraph")
    assert result.exit_code == 2 and "--context" in result.output
    docs = write_doc(tmp_path / "docs")
    result = run_cli("ingest", docs, "--store", tmp_path / "s", "--engine", "ray", "--span-tokens", "1024")
    assert result.exit_code == 2 and "--engine ragkv" in result.output
    with pytest.raises(InputError, match="--span-tokens 4096 does not fit the model's context of 1024"):
        build_store(docs, tmp_path / "s", str(tiny_llama), chunk_tokens=24, span_tokens=4096)
    assert not (tmp_path / "s").exists()  # nothing written


def test_order_reuse_moves_the_run_the_store_holds_most_of_to_the_front():
    from ragkv.retrieval.retriever import reuse_first
    from ragkv.store import ContextRow, EntryRow

    def row(chunk_id, doc, index, tokens, stored=True, span_start=None, live=False):
        entry = EntryRow(f"k{chunk_id}", "s", f"k{chunk_id}", tokens, "float32", "c", 1) if stored else None
        return ContextRow(chunk_id, doc, doc, index, "t", (1,) * tokens, entry, span_start, live)

    alone = row(1, "a.md", 0, 10)
    span = [row(2, "b.md", 0, 8, span_start=0), row(3, "b.md", 1, 8, span_start=0)]  # 16 tokens as one run
    missing = row(4, "c.md", 0, 40, stored=False)  # not stored: computed, reuses nothing
    retrieved = [(r, 1.0) for r in (alone, *span, missing)]
    assert [r.chunk_id for r, _ in reuse_first(retrieved)] == [2, 3, 1, 4]
    assert [r.chunk_id for r, _ in reuse_first([(alone, 1.0), (missing, 0.5)])] == [1, 4]
    mid_span = row(5, "d.md", 3, 90, span_start=0)  # continues a span: it loads nothing on its own
    assert [r.chunk_id for r, _ in reuse_first([(alone, 1.0), (mid_span, 0.5)])] == [1, 5]


def test_ingest_engine_names_what_serve_names_and_its_old_name_still_works(tmp_path, tiny_llama, caplog):
    """`--engine ragkv` (the default) is ragkv's own engine, as on `ragkv serve`; "local", its old
    name, builds the same store and says the new name."""
    docs = write_doc(tmp_path / "docs")
    reports = {}
    for name in ("ragkv", "local"):
        with caplog.at_level("WARNING", logger="ragkv"):
            report = ragkv.ingest(
                [docs], tmp_path / name, model=ModelSettings(model=str(tiny_llama), device="cpu"), engine=name
            )
        reports[name] = (report.engine, report.kv_computed)
    assert reports["ragkv"] == reports["local"] == ("ragkv", reports["ragkv"][1]) and reports["ragkv"][1] > 0
    assert "--engine local is now --engine ragkv" in caplog.text
    with pytest.raises(InputError, match="unknown --engine 'spark'; use one of ragkv, ray, vllm"):
        ragkv.ingest([docs], tmp_path / "x", model=ModelSettings(model=str(tiny_llama), device="cpu"), engine="spark")
