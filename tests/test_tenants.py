"""Many teams on one `ragkv serve`, tested as an attacker would: two tenants with disjoint filters
over one store and a third with its own store. Every route and every way of naming a document
(doc_ids, filters, chunk ids, another tenant's conversation history, streaming, rerank, batch)
must leave answers, sources, errors, metrics and the audit log free of the other tenant's
documents; prefix-cache hits are a tenant's own."""

from __future__ import annotations

import json
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ragkv
from ragkv.core.errors import InputError
from ragkv.serve.api import ServeSettings
from ragkv.serve.api_keys import key_digest, parse_keys, read_keys
from ragkv.serve.service import build_app, reload_keys_on_sighup
from tests.conftest import build_store

SECRET = "zebraquartz"  # in every HR document's text, and nowhere else
MAIN = [
    {"id": "hr1", "text": f"Salary bands {SECRET} for level three are reviewed each March.", "team": "hr"},
    {"id": "hr2", "text": f"Parental leave {SECRET} policy gives twenty weeks of paid leave.", "team": "hr"},
    {"id": "eng1", "text": "Kubernetes rollouts go out as canaries to ten percent of traffic.", "team": "eng"},
    {"id": "eng2", "text": "The deploy pipeline runs the unit tests before every merge.", "team": "eng"},
    {"id": "all1", "text": "The office opens at nine and closes at six on weekdays.", "team": "all"},
    {"id": "all2", "text": "Fire drills happen every quarter in the main hall downstairs.", "team": "all"},
]
OPS = [{"id": "ops1", "text": "The pager rotation hands over every Monday at ten.", "team": "ops"}]
HR_IDS, ENG_VISIBLE = {"hr1", "hr2"}, {"eng1", "eng2", "all1", "all2"}
KEYS = {"hr": "key-hr-0001", "eng": "key-eng-0002", "ops": "key-ops-0003", "slow": "key-slow-0004"}


def keys_toml(extra: str = "") -> str:
    def entry(name: str, body: str) -> str:
        return f'[[keys]]\ntenant = "{name}"\nsha256 = "{key_digest(KEYS[name]).hex()}"\n{body}\n'

    return (
        entry("hr", 'stores = ["main"]\nfilters = ["team=hr or team=all"]')
        + entry("eng", 'stores = ["main"]\nfilters = ["team=eng or team=all"]')
        + entry("ops", 'stores = ["ops"]')
        + entry("slow", 'stores = ["main"]\nfilters = ["team=eng"]\nmax_tokens = 2\nrequests_per_minute = 1')
        + extra
    )


@pytest.fixture(scope="module")
def stores(tmp_path_factory, tiny_llama):
    root = tmp_path_factory.mktemp("tenants")
    for name, records in (("main", MAIN), ("ops", OPS)):
        (root / name).mkdir()
        (root / name / "notes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        build_store(root / name, root / f"{name}-store", str(tiny_llama))
    return root


@pytest.fixture(scope="module")
def service(stores):
    keys = stores / "keys.toml"
    keys.write_text(keys_toml())
    settings = ServeSettings(keys_file=str(keys), audit_log=str(stores / "audit.jsonl"))
    with ragkv.open(stores / "main-store") as main, ragkv.open(stores / "ops-store", share=main) as ops:
        app = build_app({"main": main, "ops": ops}, settings)
        with TestClient(app) as client:
            yield client, app, stores


def call(client, tenant: str, path: str, body: dict | None = None):
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
    if body is None:
        return client.get(path, headers=headers)
    return client.post(path, json=body, headers=headers)


def chat(client, tenant: str, question: str, ragkv_options: dict | None = None, **more):
    body = {"model": "main", "messages": [{"role": "user", "content": question}], "max_tokens": 3, **more}
    return call(client, tenant, "/v1/chat/completions", {**body, "ragkv": ragkv_options or {}})


def assert_nothing_of_hr(text: str) -> None:
    assert SECRET not in text and not any(f'"{doc}"' in text or f"'{doc}'" in text for doc in HR_IDS), text


def test_a_tenant_retrieves_and_is_answered_only_from_its_scope(service):
    client, _, _ = service
    for route_body in ({"top_k": 6}, {"top_k": 6, "rerank": 4}, {"top_k": 6, "retrieval": "lexical"}):
        reply = call(client, "eng", "/v1/retrieve", {"query": f"salary bands {SECRET}", **route_body})
        found = {r["doc_id"] for r in reply.json()["data"]}
        assert reply.status_code == 200 and found <= ENG_VISIBLE  # lexical: only those sharing a word
        assert found == ENG_VISIBLE or route_body.get("retrieval") == "lexical"
        assert_nothing_of_hr(reply.text)
    answer = chat(client, "eng", f"What are the salary bands {SECRET}?", {"top_k": 3, "rerank": 4})
    assert answer.status_code == 200
    assert {s["doc_id"] for s in answer.json()["ragkv"]["sources"]} <= ENG_VISIBLE
    assert_nothing_of_hr(answer.text)
    mine = call(client, "hr", "/v1/retrieve", {"query": "salary bands", "top_k": 6}).json()["data"]
    assert {r["doc_id"] for r in mine} == HR_IDS | {"all1", "all2"}


def test_a_filter_only_narrows_the_scope(service):
    client, _, _ = service
    for filters in (["team=hr"], ["team=hr or team=eng"], ["team!=eng"], ["id=hr*"]):
        reply = call(client, "eng", "/v1/retrieve", {"query": "salary leave", "top_k": 6, "filters": filters})
        assert reply.status_code == 200 and {r["doc_id"] for r in reply.json()["data"]} <= ENG_VISIBLE
        assert_nothing_of_hr(reply.text)
    empty = chat(client, "eng", "salary?", {"filters": ["team=hr"]})
    nothing = chat(client, "eng", "salary?", {"filters": ["team=nobody"]})
    assert empty.status_code == nothing.status_code == 404 and empty.json() == nothing.json()


def test_a_document_outside_the_scope_answers_as_one_that_does_not_exist(service):
    client, _, _ = service
    for doc_id in HR_IDS:
        outside = call(client, "eng", "/v1/retrieve", {"query": "leave", "doc_ids": [doc_id]})
        missing = call(client, "eng", "/v1/retrieve", {"query": "leave", "doc_ids": ["hr9"]})
        assert outside.status_code == missing.status_code == 400
        assert outside.text.replace(doc_id, "X") == missing.text.replace("hr9", "X")
        asked = chat(client, "eng", "leave?", {"doc_ids": [doc_id]})
        assert asked.status_code == 400 and asked.text.replace(doc_id, "X") == chat(
            client, "eng", "leave?", {"doc_ids": ["hr9"]}
        ).text.replace("hr9", "X")
    mine = chat(client, "hr", "leave?", {"doc_ids": ["hr2"]})
    assert [s["doc_id"] for s in mine.json()["ragkv"]["sources"]] == ["hr2"]


def test_chunk_ids_cannot_be_sent_and_unknown_options_are_refused(service):
    client, _, _ = service
    hr_chunk = call(client, "hr", "/v1/retrieve", {"query": "salary", "doc_ids": ["hr1"]}).json()["data"][0]
    reply = chat(client, "eng", "salary?", {"chunks": [[hr_chunk["chunk_id"], 1.0]]})
    assert reply.status_code == 400 and "chunks" in reply.text
    assert_nothing_of_hr(reply.text)


def test_another_tenants_history_never_reaches_its_kept_conversation(service):
    client, _, _ = service
    question = f"Which salary band {SECRET} is level three in?"  # asked by no other test
    said = chat(client, "hr", question, {"top_k": 2}).json()["choices"][0]["message"]["content"]
    history = [
        {"role": "user", "content": question},
        {"role": "assistant", "content": said},
        {"role": "user", "content": "And for level four?"},
    ]
    body = {"model": "main", "messages": history, "max_tokens": 3, "ragkv": {"top_k": 2}}
    theirs = call(client, "eng", "/v1/chat/completions", body).json()
    assert theirs["ragkv"]["conversation_reused"] is False
    assert {s["doc_id"] for s in theirs["ragkv"]["sources"]} <= ENG_VISIBLE
    again = call(client, "hr", "/v1/chat/completions", body).json()
    assert again["ragkv"]["conversation_reused"] is True  # the tenant's own follow-up still reuses


def test_streaming_carries_only_the_scopes_sources_and_the_usage(service):
    client, _, _ = service
    body = {
        "model": "main",
        "messages": [{"role": "user", "content": f"salary bands {SECRET}"}],
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ragkv": {"top_k": 3},
    }
    with client.stream(
        "POST", "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEYS['eng']}"}
    ) as reply:
        text = "".join(reply.iter_text())
    assert_nothing_of_hr(text)
    last = json.loads([line for line in text.splitlines() if line.startswith("data: {")][-1][6:])
    assert {s["doc_id"] for s in last["ragkv"]["sources"]} <= ENG_VISIBLE
    assert last["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_models_list_only_the_callers_stores_and_a_forbidden_store_does_not_exist(service):
    client, _, _ = service
    assert [m["id"] for m in call(client, "eng", "/v1/models").json()["data"]] == ["main"]
    assert [m["id"] for m in call(client, "ops", "/v1/models").json()["data"]] == ["ops"]
    forbidden = call(
        client, "eng", "/v1/chat/completions", {"model": "ops", "messages": [{"role": "user", "content": "x"}]}
    )
    unknown = call(
        client, "eng", "/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}
    )
    assert forbidden.status_code == unknown.status_code == 404
    assert forbidden.text.replace("ops", "X") == unknown.text.replace("nope", "X")
    own = call(client, "ops", "/v1/retrieve", {"query": "pager", "model": "ops"}).json()["data"]
    assert [r["doc_id"] for r in own] == ["ops1"]
    assert call(client, "ops", "/v1/retrieve", {"query": "salary", "model": "main"}).status_code == 404
    assert call(client, "eng", "/v1/cache").status_code == 403  # it would list every hot document
    assert client.get("/v1/models").status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer key-eng-0003"}).status_code == 401


def test_prefix_cache_hits_are_counted_per_tenant(service):
    """B repeating A's exact multi-chunk prompt (over documents both may read) gets no hit; A
    repeating it does."""
    client, _, _ = service

    def reused_from_cache(tenant: str) -> int:
        reply = chat(
            client,
            tenant,
            "When do fire drills happen and when does the office open?",
            {"top_k": 2, "context": "chunk", "filters": ["team=all"]},
        )
        return reply.json()["ragkv"]["stats"]["prefix_cache_tokens"]

    assert reused_from_cache("hr") == 0
    assert reused_from_cache("eng") == 0
    assert reused_from_cache("hr") > 0 and reused_from_cache("eng") > 0


def test_a_keys_cap_and_rate_hold(service):
    client, _, _ = service
    capped = chat(client, "slow", "deploys?", max_tokens=50)
    assert capped.status_code == 200 and capped.json()["usage"]["completion_tokens"] <= 2
    assert "max_tokens cut from 50 to 2" in capped.json()["ragkv"]["stats"]["warnings"]
    limited = chat(client, "slow", "deploys?")
    assert limited.status_code == 429 and int(limited.headers["retry-after"]) >= 1


def test_metrics_and_the_audit_log_name_no_other_tenants_documents(service):
    client, app, root = service
    chat(client, "eng", "rollouts?", {"top_k": 2})
    metrics = client.get("/metrics").text
    assert_nothing_of_hr(metrics)
    assert not any(tenant in metrics for tenant in ("tenant", "eng1", "hr1"))
    lines = [json.loads(line) for line in (root / "audit.jsonl").read_text().splitlines()]
    eng = [line for line in lines if line["tenant"] == "eng"]
    assert eng and all(doc in ENG_VISIBLE for line in eng for doc, _ in line["chunks"])
    assert any(line["route"] == "/v1/chat/completions" and line["completion_tokens"] for line in eng)
    assert {line["tenant"] for line in lines} >= {"hr", "eng"}
    assert not any(SECRET in json.dumps(line) for line in lines)  # no text is ever written


def test_the_python_batch_takes_the_scope_too(stores):
    scope = {"tenant": "eng", "filters": ["team=eng or team=all"]}
    with ragkv.open(stores / "main-store") as engine, engine.batched() as batch:
        with ThreadPoolExecutor(3) as pool:
            answers = list(
                pool.map(lambda q: batch.ask(q, top_k=3, max_new_tokens=2, scope=scope), ["salary", SECRET, "leave"])
            )
    assert all({s.doc_id for s in a.sources} <= ENG_VISIBLE for a in answers)


def test_sighup_reloads_the_keys_under_load_without_failing_a_request(service):
    client, app, root = service
    keys_file = root / "keys.toml"
    reload_keys_on_sighup(app.state.access)
    KEYS["new"] = "key-new-0005"
    failures, stop = [], threading.Event()

    def load() -> None:
        while not stop.is_set():
            reply = call(client, "eng", "/v1/retrieve", {"query": "deploy", "top_k": 2})
            if reply.status_code != 200:
                failures.append(reply.text)

    threads = [threading.Thread(target=load) for _ in range(3)]
    for thread in threads:
        thread.start()
    try:
        assert call(client, "new", "/v1/models").status_code == 401
        for round_ in range(5):
            extra = f'[[keys]]\ntenant = "new"\nsha256 = "{key_digest(KEYS["new"]).hex()}"\n' if round_ % 2 == 0 else ""
            keys_file.write_text(keys_toml(extra))
            os.kill(os.getpid(), signal.SIGHUP)  # the handler runs in this (the main) thread, now
            assert (call(client, "new", "/v1/models").status_code == 200) == (round_ % 2 == 0)
        keys_file.write_text("not = [toml")  # a broken file: the keys in force stay
        os.kill(os.getpid(), signal.SIGHUP)
        assert call(client, "new", "/v1/models").status_code == 200
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        keys_file.write_text(keys_toml())
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
    assert not failures


_filters = st.builds(
    lambda field, op, value: f"{field}{op}{value}",
    st.sampled_from(["team", "id", "path", "year", "source"]),
    st.sampled_from(["=", "!=", ">=", "<"]),
    st.sampled_from(["hr", "eng", "all", "hr*", "*", "e?g1", "2025", "notes.jsonl"]),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.lists(_filters, min_size=1, max_size=3).map(" or ".join), max_size=3))
def test_no_client_filter_widens_a_scope(service, filters):
    client, _, _ = service
    reply = call(client, "eng", "/v1/retrieve", {"query": "salary leave deploy", "top_k": 6, "filters": filters})
    assert reply.status_code in (200, 400)
    if reply.status_code == 200:
        assert {r["doc_id"] for r in reply.json()["data"]} <= ENG_VISIBLE
    assert_nothing_of_hr(reply.text)


_toml_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 10**6) | st.floats(allow_nan=False) | st.text(max_size=70),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=8,
)
_entries = st.fixed_dictionaries(
    {},
    optional={
        "tenant": st.text(max_size=20) | _toml_values,
        "sha256": st.just("a" * 64) | st.text(alphabet="0123456789abcdefG", min_size=60, max_size=66) | _toml_values,
        "stores": st.lists(st.text(max_size=8), max_size=3) | _toml_values,
        "filters": st.lists(st.text(max_size=30), max_size=3) | _toml_values,
        "max_tokens": st.integers(-3, 10**6) | _toml_values,
        "requests_per_minute": st.floats(-1, 1e7) | _toml_values,
        "colour": _toml_values,
    },
)


@settings(max_examples=300, deadline=None)
@given(
    st.fixed_dictionaries({}, optional={"keys": st.lists(_entries, max_size=3) | _toml_values, "stores": _toml_values})
)
def test_any_keys_file_reads_or_is_one_input_error(data):
    try:
        keys = parse_keys(data)
    except InputError as error:
        assert "\n" not in str(error)
    else:
        assert keys.keys and all(len(k.digest) == 32 and k.scope is not None and k.scope.tenant for k in keys.keys)


def test_a_keys_file_that_does_not_read_is_one_line_naming_it(tmp_path):
    path = tmp_path / "keys.toml"
    for text, said in (
        ("keys = [", "not TOML"),
        ('[[keys]]\ntenant = "a"\nsha256 = "abc"', "sha256 must be 64"),
        ('[[keys]]\ntenant = "a"\nsha256 = "' + "a" * 64 + '"\nfilters = ["team"]', "FIELD OP VALUE"),
        ("[stores]\nmain = '/x'", r"no \[\[keys\]\]"),
    ):
        path.write_text(text)
        with pytest.raises(InputError, match=said) as error:
            read_keys(path)
        assert str(path) in str(error.value) and "\n" not in str(error.value)


@pytest.mark.slow
def test_a_real_server_reports_cached_tokens_to_openais_client_and_reloads_keys_on_sighup(stores, tmp_path):
    """`ragkv serve --store main=… --store ops=… --keys FILE` as a process: OpenAI's own client
    reads `cached_tokens`, plain and streamed; SIGHUP under load takes up a new key and fails no
    request."""
    import httpx
    from openai import OpenAI

    from tests.conftest import running_server

    keys_file = tmp_path / "keys.toml"
    keys_file.write_text(keys_toml())
    store = f"main={stores / 'main-store'}"
    args = ("--store", f"ops={stores / 'ops-store'}", "--keys", str(keys_file))
    with running_server(store, *args) as (base, server):  # type: ignore[arg-type]
        client = OpenAI(base_url=f"{base}/v1", api_key=KEYS["eng"], max_retries=0)
        messages = [{"role": "user", "content": "How do rollouts go out?"}]
        reply = client.chat.completions.create(model="main", messages=messages, max_tokens=3)
        assert reply.usage.prompt_tokens_details.cached_tokens > 0
        chunks = list(
            client.chat.completions.create(
                model="main", messages=messages, max_tokens=3, stream=True, stream_options={"include_usage": True}
            )
        )
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
        assert [m.id for m in client.models.list()] == ["main"]

        failures, stop = [], threading.Event()

        def load() -> None:
            while not stop.is_set():
                sent = httpx.post(
                    f"{base}/v1/chat/completions",
                    json={"model": "main", "messages": messages, "max_tokens": 2},
                    headers={"Authorization": f"Bearer {KEYS['eng']}"},
                    timeout=600,
                )
                if sent.status_code != 200:
                    failures.append(sent.text)

        threads = [threading.Thread(target=load) for _ in range(2)]
        for thread in threads:
            thread.start()
        try:
            fresh = OpenAI(base_url=f"{base}/v1", api_key="key-fresh-0006", max_retries=0)
            with pytest.raises(Exception, match="401"):
                fresh.models.list()
            extra = f'[[keys]]\ntenant = "fresh"\nsha256 = "{key_digest("key-fresh-0006").hex()}"\nstores = ["ops"]\n'
            keys_file.write_text(keys_toml(extra))
            server.send_signal(signal.SIGHUP)
            while "keys reloaded" not in (line := server.stderr.readline()):  # the server says so once done
                assert line, "the server ended"
            assert [m.id for m in fresh.models.list()] == ["ops"]
        finally:
            stop.set()
            for thread in threads:
                thread.join()
        assert not failures


def _forbidden_reaches(function) -> set[str]:
    """The names by which `function` (a route, with the functions nested in it) could reach an
    engine without the caller's handle."""
    names, codes = set(), [function.__code__]
    while codes:
        code = codes.pop()
        names |= set(code.co_names)
        codes += [c for c in code.co_consts if hasattr(c, "co_names")]
    return names & {"engines", "_engines", "first", "_engine", "loader", "runtime", "retriever"}


def test_every_route_takes_its_caller_and_reaches_a_store_only_through_its_handle(service, stores):
    """Both fronts: every route but /healthz and /metrics depends on the caller (`Access`), and
    no route names an engine: the handle `Stores.open(model, caller)` returns, which applies the
    caller's scope, caps and audit, is its only way to a store. A route added without it fails here."""
    from fastapi.routing import APIRoute

    from ragkv.serve.vllm_front import build_front_app

    _, app, _ = service
    with ragkv.open(stores / "main-store", weights=False) as front_engine:
        front = build_front_app(front_engine, "http://127.0.0.1:9", ServeSettings())
        for served in (app, front):
            routes = [route for route in served.routes if isinstance(route, APIRoute)]
            assert {"/v1/chat/completions", "/v1/models"} <= {route.path for route in routes}
            for route in routes:
                if route.path in ("/healthz", "/metrics", "/ui", "/ui/app.js", "/ui/style.css"):
                    continue  # no data: the page's own files, like /healthz and /metrics
                assert served.state.access in {dep.call for dep in route.dependant.dependencies}, route.path
                assert not _forbidden_reaches(route.endpoint), (route.path, _forbidden_reaches(route.endpoint))


def test_the_dashboard_shows_a_filtered_key_its_own_documents_and_nothing_server_wide(service):
    """/ui's JSON, as an attacker with the eng key would use it: the store panel lists only what
    the key's filters admit (no HR id, no HR text, no store-wide figure); asking for HR chunk
    texts by id gets nothing; the charts, what is hot and the tenants (every tenant's counts)
    are refused; another team's store answers as if it did not exist."""
    client, _, _ = service
    hr = call(client, "hr", "/v1/ui/store?model=main").json()
    assert {d["doc_id"] for d in hr["listed"]} == HR_IDS | {"all1", "all2"} and hr["filtered"]
    hr_chunks = [c["chunk_id"] for d in hr["listed"] if d["doc_id"] in HR_IDS for c in d["chunks"]]
    eng = call(client, "eng", "/v1/ui/store?model=main")
    assert eng.status_code == 200 and "store" not in eng.json() and eng.json()["filtered"]
    assert {d["doc_id"] for d in eng.json()["listed"]} == ENG_VISIBLE and eng.json()["documents"] == 4
    assert SECRET not in eng.text and not any(doc_id in eng.text for doc_id in HR_IDS)
    texts = call(client, "eng", "/v1/ui/chunks", {"model": "main", "chunk_ids": hr_chunks})
    assert hr_chunks and texts.status_code == 200 and texts.json() == {"chunks": {}}
    assert call(client, "eng", "/v1/ui/series").status_code == 403
    assert call(client, "eng", "/v1/cache?model=main").status_code == 403
    assert call(client, "ops", "/v1/ui/store?model=main").status_code == 404
    wide = call(client, "ops", "/v1/ui/series")  # a key without filters: every tenant's counts
    assert wide.status_code == 200 and wide.json()["now"]["requests"] > 0
