"""Scopes in the library (ragkv.core.scope): what a caller may read, and whose caches it shares.
The service's keys build on these (tests/test_tenants.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ragkv
from ragkv.core.errors import InputError
from ragkv.core.filters import AnyOf, Filter, parse_filter
from ragkv.core.scope import Scope
from tests.test_filters import filtered_store  # noqa: F401 - the store the filter tests use

RUNBOOKS = {"runbooks/deploy.md", "runbooks/rollback.md"}
SCOPE = Scope("ops", ("path=runbooks/* or team=infra",))
IN_SCOPE = RUNBOOKS | {"n2026"}


def test_or_joins_comparisons_and_a_quoted_value_keeps_the_word():
    assert parse_filter("path=handbook/* or team=hr") == AnyOf(
        (Filter("path", "=", "handbook/*"), Filter("team", "=", "hr"))
    )
    assert parse_filter("title='War or Peace'") == Filter("title", "=", "War or Peace")
    assert parse_filter("a=1 OR b>2").to_string() == "a=1 or b>2"
    with pytest.raises(InputError, match="FIELD OP VALUE"):
        parse_filter("a=1 or or b=2")


_values = st.text(st.characters(codec="utf-8", exclude_characters="'\"\n\r"), min_size=1, max_size=12).filter(
    lambda v: v.strip() == v
)
_comparisons = st.builds(
    Filter,
    st.sampled_from(["path", "team", "year", "x_1"]),
    st.sampled_from(["=", "!=", ">", ">=", "<", "<="]),
    _values,
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_comparisons, min_size=1, max_size=4))
def test_a_condition_reads_back_as_itself(comparisons):
    condition = comparisons[0] if len(comparisons) == 1 else AnyOf(tuple(comparisons))
    assert parse_filter(condition.to_string()) == condition


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=60))
def test_any_text_is_a_condition_or_one_input_error(text):
    try:
        condition = parse_filter(text)
    except InputError as error:
        assert "\n" not in str(error)
    else:
        assert parse_filter(condition.to_string()) == condition


def test_a_scope_is_built_from_a_mapping_and_refuses_unknown_fields():
    assert Scope.of({"tenant": "hr", "filters": "team=hr"}) == Scope("hr", ("team=hr",))
    with pytest.raises(InputError, match="unknown scope field"):
        Scope.of({"tenant": "hr", "stores": ["a"]})
    with pytest.raises(InputError, match="FIELD OP VALUE"):
        Scope("hr", ("team",))
    inner = Scope("", ("year>=2025",)).within(SCOPE)
    assert inner == Scope("ops", (*SCOPE.filters, "year>=2025"))


def _doc_ids(results) -> set[str]:
    return {r.doc_id for r in results}


def test_a_scope_bounds_search_and_a_client_filter_only_narrows_it(filtered_store):  # noqa: F811
    with ragkv.open(filtered_store) as engine:
        assert _doc_ids(engine.search("deploy", 10, settings=None)) - IN_SCOPE  # unscoped: more than the scope
        scoped = ragkv.AskSettings(top_k=10, scope=SCOPE).search
        assert _doc_ids(engine.search("deploy", settings=scoped)) == IN_SCOPE
        wider = ragkv.AskSettings(top_k=10, scope=SCOPE, filters=("path=handbook/* or year>=2023",)).search
        assert _doc_ids(engine.search("leave deploy", settings=wider)) == {"n2026"}
        with ragkv.open(filtered_store, scope={"tenant": "ops", "filters": ["path=runbooks/*"]}) as bounded:
            assert _doc_ids(bounded.search("leave", 10)) == RUNBOOKS  # the engine's own scope
            assert _doc_ids(bounded.search("leave", 10, filters=["team=infra"])) == set()
            answer = bounded.ask("Who approves leave?", top_k=3, max_new_tokens=2)
            assert {s.doc_id for s in answer.sources} <= RUNBOOKS


def test_a_document_outside_the_scope_answers_as_one_the_store_lacks(filtered_store):  # noqa: F811
    with ragkv.open(filtered_store) as engine:
        errors = []
        for doc_id in ("handbook/leave.md", "no/such.md"):
            with pytest.raises(InputError) as error:
                engine.search("leave", settings=ragkv.AskSettings(doc_ids=(doc_id,), scope=SCOPE).search)
            errors.append(str(error.value).replace(doc_id, "DOC"))
        assert errors[0] == errors[1]
        leave = engine.search("leave", 1, doc_ids=["handbook/leave.md"]).hits[0].chunk_id
        deploy = engine.search("canaries", 1, doc_ids=["runbooks/deploy.md"]).hits[0].chunk_id
        for chunk_id in (leave, 10**6):  # another tenant's chunk, and one that does not exist
            with pytest.raises(InputError, match="1 of the given chunks are not in store"):
                engine.ask("Who approves leave?", chunks=((chunk_id, 1.0),), scope=SCOPE, max_new_tokens=2)
        answer = engine.ask("How do deploys go out?", chunks=((deploy, 1.0),), scope=SCOPE, max_new_tokens=2)
        assert [s.doc_id for s in answer.sources] == ["runbooks/deploy.md"]


def test_prefix_cache_hits_are_a_tenants_own(filtered_store):  # noqa: F811
    """Tenant B asking A's exact multi-chunk prompt gets no hit from the prefix cache; A asking it
    again does."""
    with ragkv.open(filtered_store) as engine:

        def cached_tokens(tenant: str) -> int:
            scope = Scope(tenant, ("path=runbooks/*",))
            answer = engine.ask("deploy rollback", top_k=2, max_new_tokens=1, context="chunk", scope=scope)
            return answer.stats.prefix_cache_tokens

        assert cached_tokens("a") == 0
        assert cached_tokens("b") == 0
        assert cached_tokens("a") > 0
        assert cached_tokens("b") > 0


def test_a_second_store_shares_the_loaded_model_and_answers_as_alone(filtered_store, tiny_store):  # noqa: F811
    question = "How do I rotate the API key?"
    with ragkv.open(tiny_store) as alone:
        expected = alone.ask(question, max_new_tokens=6)
    with ragkv.open(filtered_store) as first, ragkv.open(tiny_store, share=first) as second:
        assert second.lm is first.lm and second.engine is first.engine
        answer = second.ask(question, max_new_tokens=6)
        assert answer.token_ids == expected.token_ids and answer.sources == expected.sources
        assert second.search("deploy canaries", 3).hits == first_hits(tiny_store)


def first_hits(store):
    with ragkv.open(store) as engine:
        return engine.search("deploy canaries", 3).hits


def test_chunk_texts_leave_out_what_the_scope_does_not_admit(filtered_store):  # noqa: F811
    with ragkv.open(filtered_store, scope={"filters": ["path=runbooks/*"]}) as engine:
        every = engine.runtime.snapshot.catalog.documents.chunk_ids()
        texts = engine.chunk_texts(sorted(every))
        assert texts and len(texts) < len(every) and all("Leave" not in t for t in texts.values())
        assert engine.chunk_texts(sorted(every), scope={"filters": ["path=nowhere"]}) == {}
