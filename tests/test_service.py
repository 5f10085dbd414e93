"""`ragkv serve`: a real server on a free loopback port, spoken to with the official openai
client and httpx. Answers equal `ask`; bad requests get JSON 4xx and leave it healthy; a
re-index published while a client loops fails no request."""

from __future__ import annotations

import shutil
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from openai import OpenAI

import ragkv
from ragkv.core.config import ModelSettings
from ragkv.store import open_snapshot
from tests.conftest import QUESTIONS, run_cli, running_server

pytestmark = pytest.mark.slow  # a real `ragkv serve`

KEY = "test-key-123"


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_store, corpus):
    """A server over a copy of the tiny store (so the test may re-index it), with an API key."""
    root = tmp_path_factory.mktemp("served")
    store, docs = root / "store", root / "docs"
    shutil.copytree(tiny_store, store)
    shutil.copytree(corpus, docs)
    with running_server(store, "--max-queue", "3", "--max-tokens-cap", "64", env={"RAGKV_API_KEY": KEY}) as (base, _):
        yield base, store, docs


def client(base: str) -> OpenAI:
    return OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)


def post(base, body, key=KEY, **kwargs):
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    return httpx.post(
        f"{base}/v1/chat/completions",
        headers=headers,
        timeout=600,
        **kwargs,
        **({"json": body} if not isinstance(body, (bytes, str)) else {"content": body}),
    )


def test_answers_equal_ask_streaming_or_not(served, tiny_store):
    base, _, _ = served
    with ragkv.open(tiny_store, device="cpu") as engine:
        expected = engine.ask(QUESTIONS[0], max_new_tokens=12)
    reply = client(base).chat.completions.create(
        model="ragkv", messages=[{"role": "user", "content": QUESTIONS[0]}], max_tokens=12
    )
    assert reply.choices[0].message.content == expected.text
    extra = reply.model_extra["ragkv"]
    assert extra["token_ids"] == expected.token_ids and extra["stats"]["reused_tokens"] > 0
    assert extra["sources"][0]["chunk_id"] == expected.sources[0].chunk_id
    assert reply.usage.completion_tokens == len(expected.token_ids)

    pieces, last = [], None
    for event in client(base).chat.completions.create(
        model="ragkv", messages=[{"role": "user", "content": QUESTIONS[0]}], max_tokens=12, stream=True
    ):
        pieces.append(event.choices[0].delta.content or "")
        last = event
    assert "".join(pieces) == expected.text
    assert last.choices[0].finish_reason == "length" and last.model_extra["ragkv"]["token_ids"] == expected.token_ids


def test_a_follow_up_reuses_the_conversation(served):
    base, _, _ = served
    first = client(base).chat.completions.create(
        model="ragkv", messages=[{"role": "user", "content": QUESTIONS[1]}], max_tokens=8
    )
    history = [
        {"role": "user", "content": QUESTIONS[1]},
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And who approves it?"},
    ]
    follow = client(base).chat.completions.create(model="ragkv", messages=history, max_tokens=8)
    stats = follow.model_extra["ragkv"]
    assert stats["conversation_reused"] and stats["stats"]["computed_tokens"] < 30
    assert stats["stats"]["reused_tokens"] >= first.usage.prompt_tokens


def test_other_endpoints(served):
    base, _, _ = served
    auth = {"Authorization": f"Bearer {KEY}"}
    (listed,) = client(base).models.list().data
    assert listed.id == "ragkv" and listed.owned_by == "ragkv" and listed.model_extra["root"]
    found = httpx.post(f"{base}/v1/retrieve", json={"query": QUESTIONS[2], "top_k": 2}, headers=auth).json()["data"]
    assert len(found) == 2 and found[0]["doc_id"] == "payroll" and found[0]["score"] >= found[1]["score"]
    metrics = httpx.get(f"{base}/metrics").text
    for name in (
        "ragkv_requests_total",
        "ragkv_ttft_seconds_bucket",
        "ragkv_tokens_reused_total",
        "ragkv_ram_tier_hits",
        "ragkv_store_generation",
    ):
        assert name in metrics


def test_the_cache_endpoint_names_the_chunks_held_hot(served):
    base, _, _ = served
    auth = {"Authorization": f"Bearer {KEY}"}
    reply = post(base, {"messages": [{"role": "user", "content": QUESTIONS[3]}], "max_tokens": 4}).json()["ragkv"]
    stored = {int(c) for c, source in reply["stats"]["kv_sources"].items() if source in ("store", "ram")}
    assert stored  # the tiny store holds every chunk's KV
    cache = httpx.get(f"{base}/v1/cache", headers=auth).json()
    held = {c["chunk_id"]: c["doc_id"] for c in cache["chunks"]}
    assert stored <= set(held)  # what the answer read is held now
    assert {s["doc_id"] for s in reply["sources"] if s["chunk_id"] in stored} <= set(cache["documents"])
    assert cache["entries"] >= 1 and 0 < cache["bytes"] <= cache["max_bytes"]
    assert cache["generation"] == httpx.get(f"{base}/healthz").json()["generation"]
    metrics = httpx.get(f"{base}/metrics").text
    assert f"ragkv_ram_tier_entries {float(cache['entries'])}" in metrics
    assert httpx.get(f"{base}/v1/cache").status_code == 401


@pytest.mark.parametrize("key, status", [(None, 401), ("wrong", 401)])
def test_requests_without_the_key_are_refused(served, key, status):
    base, _, _ = served
    response = post(base, {"messages": [{"role": "user", "content": "hi"}]}, key=key)
    assert response.status_code == status and response.json()["error"]["type"] == "invalid_api_key"
    assert httpx.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {key}"} if key else {}).status_code == 401


@pytest.mark.parametrize(
    "body, status, fragment",
    [
        (b"{not json", 400, "not valid JSON"),
        ({"model": "x"}, 400, "messages"),
        ({"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}, 404, "does not exist"),
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400, "temperature"),
        ({"messages": []}, 400, "messages"),
        ({"messages": [{"role": "assistant", "content": "hi"}]}, 400, "last message must be a user message"),
        ({"messages": [{"role": "user", "content": "hi"}], "ragkv": {"mode": "fast"}}, 400, "mode"),
        ({"messages": [{"role": "user", "content": "hi"}], "ragkv": {"context": "page"}}, 400, "context"),
        ({"messages": [{"role": "user", "content": "hi"}], "ragkv": {"doc_ids": ["no-such-doc"]}}, 400, "no-such-doc"),
        ({"messages": [{"role": "user", "content": "hi"}], "ragkv": {"doc_ids": ["d"] * 101}}, 400, "doc_ids"),
        ({"messages": [{"role": "user", "content": "x" * (2 << 20)}]}, 413, "over"),
    ],
)
def test_bad_requests_get_json_errors_and_the_server_stays_healthy(served, body, status, fragment):
    base, _, _ = served
    response = post(base, body)
    assert response.status_code == status, response.text
    assert fragment in response.json()["error"]["message"]
    assert httpx.get(f"{base}/healthz").json()["status"] == "ok"


def test_max_tokens_is_capped_and_said(served):
    base, _, _ = served
    reply = post(base, {"messages": [{"role": "user", "content": QUESTIONS[0]}], "max_tokens": 100000}).json()
    assert reply["usage"]["completion_tokens"] <= 64
    assert any("cut from 100000 to 64" in w for w in reply["ragkv"]["stats"]["warnings"])


def test_requests_join_a_running_stream_and_equal_their_lone_answers(served):
    """While a streamed answer decodes, two non-streaming questions arrive: they join the
    running batch (continuous batching) and still equal their lone answers."""
    base, _, _ = served
    body = {"messages": [{"role": "user", "content": QUESTIONS[0]}], "max_tokens": 16}
    alone = post(base, body).json()
    assert alone["ragkv"]["stats"]["batch_size"] == 1
    busy = {"messages": [{"role": "user", "content": QUESTIONS[2]}], "max_tokens": 64, "stream": True}
    for _ in range(5):  # the two must arrive while the streamed answer still runs
        with httpx.stream(
            "POST", f"{base}/v1/chat/completions", json=busy, timeout=600, headers={"Authorization": f"Bearer {KEY}"}
        ) as stream:
            lines = stream.iter_lines()
            next(line for line in lines if '"content": "' in line and '"content": ""' not in line)
            with ThreadPoolExecutor(2) as pool:
                replies = list(pool.map(lambda _: post(base, body), range(2)))
            for _ in lines:
                pass
        assert [r.status_code for r in replies] == [200, 200]
        if all(r.json()["ragkv"]["stats"]["batch_size"] >= 2 for r in replies):
            break
    else:
        pytest.fail("the questions never joined the running batch")
    for reply in replies:
        assert reply.json()["ragkv"]["token_ids"] == alone["ragkv"]["token_ids"]


def test_a_full_queue_answers_503_with_retry_after(served, tiny_store):
    """One row and room for one waiting request: with a stream decoding in the row and a request
    waiting (both seen in /healthz), the next gets 503 with Retry-After; once the stream leaves,
    the waiting one is answered. (The tiny model streams its 1,024 tokens in about a second: a
    try whose stream ended before the third request arrived is tried again.)"""
    _, store, _ = served
    with ragkv.open(tiny_store, device="cpu") as engine:  # the stream runs its whole budget
        assert engine.ask(QUESTIONS[3], max_new_tokens=1024).stats.finish_reason == "length"
    long = {"messages": [{"role": "user", "content": QUESTIONS[3]}], "max_tokens": 1024, "stream": True}
    short = {"messages": [{"role": "user", "content": QUESTIONS[0]}], "max_tokens": 4}
    args = ("--max-batch", "1", "--max-queue", "1", "--max-tokens-cap", "1024")
    with running_server(store, *args, env={"RAGKV_API_KEY": KEY}) as (base, _), ThreadPoolExecutor(1) as pool:
        headers = {"Authorization": f"Bearer {KEY}"}
        for _ in range(5):
            with httpx.stream("POST", f"{base}/v1/chat/completions", json=long, timeout=600, headers=headers) as stream:
                lines = stream.iter_lines()
                next(line for line in lines if '"content": "' in line)  # it holds the one row
                waiting = pool.submit(post, base, short)
                while httpx.get(f"{base}/healthz").json()["waiting"] < 1:
                    assert not waiting.done(), waiting.result().text
                busy = post(base, short)
            assert waiting.result().status_code == 200  # the stream left: its row went to the waiting one
            assert busy.status_code in (200, 503), busy.text
            if busy.status_code == 503:
                break
        else:
            pytest.fail("the stream always ended before the third request arrived")
        assert busy.headers["retry-after"] == "1" and busy.json()["error"]["type"] == "server_busy"


def test_a_burst_gets_clean_503s_and_nothing_else_fails(served):
    base, _, _ = served
    body = {"messages": [{"role": "user", "content": QUESTIONS[2]}], "max_tokens": 4}
    with ThreadPoolExecutor(32) as pool:
        codes = [r.status_code for r in pool.map(lambda _: post(base, body), range(200))]
    assert set(codes) <= {200, 503} and codes.count(200) >= 3 and 503 in codes
    assert httpx.get(f"{base}/healthz").json()["status"] == "ok"


def test_clients_that_disconnect_mid_stream_leave_no_sequence_behind(served):
    base, _, _ = served
    body = {"messages": [{"role": "user", "content": QUESTIONS[0]}], "max_tokens": 64, "stream": True}
    for _ in range(3):
        with httpx.stream(
            "POST", f"{base}/v1/chat/completions", json=body, timeout=600, headers={"Authorization": f"Bearer {KEY}"}
        ) as stream:
            next(line for line in stream.iter_lines() if '"content": "' in line and '"content": ""' not in line)
        # leaving the block closed the connection mid-answer
    while True:  # the server notices at its next write and frees the row at the next step
        metrics = httpx.get(f"{base}/metrics").text
        running = next(line for line in metrics.splitlines() if line.startswith("ragkv_batch_running "))
        if float(running.split()[1]) == 0:
            break
    assert "ragkv_requests_waiting 0.0" in metrics and "ragkv_tokens_per_second" in metrics
    assert post(base, {"messages": [{"role": "user", "content": QUESTIONS[1]}], "max_tokens": 4}).status_code == 200


def test_a_reindex_published_while_a_client_loops_fails_no_request(served, tiny_llama):
    base, store, docs = served
    results, stop, answered = [], threading.Event(), threading.Condition()

    def loop():
        while not stop.is_set():
            response = post(
                base, {"messages": [{"role": "user", "content": "When are salaries paid?"}], "max_tokens": 4}
            )
            with answered:
                results.append((response.status_code, response.json()))
                answered.notify_all()

    def answered_from(generation: int) -> bool:
        return any(
            body.get("ragkv", {}).get("stats", {}).get("store_generation", 0) >= generation for _, body in results
        )

    thread = threading.Thread(target=loop)
    thread.start()
    try:
        for version in range(3):
            (docs / "payroll-extra.md").write_text(f"Payroll notice {version}: salaries are paid on the 25th.")
            report = ragkv.ingest([docs], store, model=ModelSettings(model=str(tiny_llama), device="cpu"), prune=True)
            with answered:  # the client has been answered from the new generation (a hang guard, not a timing)
                generation = report.generation
                assert answered.wait_for(lambda g=generation: answered_from(g), timeout=600)
    finally:
        stop.set()
        thread.join()
    assert results and all(status == 200 for status, _ in results), [r for r in results if r[0] != 200][:1]
    generations = [body["ragkv"]["stats"]["store_generation"] for _, body in results]
    assert generations == sorted(generations) and generations[-1] > generations[0]
    assert all(body["ragkv"]["stats"]["mode"] == "exact" for _, body in results)


def test_a_chunk_without_kv_is_computed_then_kept_in_ram(served):
    """Runs last: it evicts the served store's chunk KV (a budget of the prefix alone)."""
    base, store, _ = served
    with open_snapshot(store) as snapshot:
        prefix_bytes = snapshot.catalog.reports.prefix_bytes()
    assert run_cli("budget", prefix_bytes, "--store", store).exit_code == 0
    body = {
        "messages": [{"role": "user", "content": "Which network do guests use, and where is its password?"}],
        "max_tokens": 4,
    }
    first, second = post(base, body).json(), post(base, body).json()
    assert first["ragkv"]["sources"][0]["doc_id"] == "wifi"
    assert (first["ragkv"]["stats"]["kv_source"], second["ragkv"]["stats"]["kv_source"]) == ("computed", "ram")
    assert first["ragkv"]["token_ids"] == second["ragkv"]["token_ids"]


def test_a_chat_request_is_one_settings_value_for_both_fronts():
    from ragkv.serve.api import ChatRequest

    body = ChatRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "q"}],
            "temperature": 0.5,
            "seed": 7,
            "stop": "END",
            "ragkv": {"top_k": 3, "no_cache": True, "doc_ids": ["a"], "filters": ["year>=2025"], "mode": "concat"},
        }
    )
    settings = body.ask_settings(max_new_tokens=40)
    assert (settings.top_k, settings.use_cache, settings.mode, settings.max_new_tokens) == (3, False, "concat", 40)
    assert (settings.doc_ids, settings.filters) == (("a",), ("year>=2025",))
    assert (settings.decoding.temperature, settings.decoding.seed, settings.decoding.stop) == (0.5, 7, ("END",))


def test_every_front_checks_its_options_in_one_place():
    from pydantic import ValidationError

    from ragkv.core.config import AskSettings
    from ragkv.core.errors import InputError
    from ragkv.integrations.adapter import AnswerOptions
    from ragkv.serve.api import ChatRequest

    # The same bad option is refused with the same message by the CLI's, the adapters' and the
    # OpenAI fronts' settings: AskSettings is the one check.
    with pytest.raises(InputError) as cli:
        AskSettings.from_dict({"mode": "fast"})
    with pytest.raises(ValidationError) as adapter:
        AnswerOptions(mode="fast")
    body = ChatRequest.model_validate({"messages": [{"role": "user", "content": "q"}], "ragkv": {"mode": "fast"}})
    with pytest.raises(InputError) as openai:
        body.ask_settings(max_new_tokens=8)
    assert str(cli.value) in str(adapter.value) and str(openai.value) == str(cli.value)

    options = AnswerOptions(top_k=2, mode="concat", stop=["END"], seed=3, max_tokens=9, repetition_penalty=1.0)
    settings = options.ask_settings(passages=["p"], max_tokens=5)
    assert (settings.top_k, settings.mode, settings.max_new_tokens, settings.passages) == (2, "concat", 5, ("p",))
    assert (settings.decoding.stop, settings.decoding.seed, settings.decoding.repetition_penalty) == (("END",), 3, 1.0)
    assert options.ask_settings(stop=["X"]).decoding.stop == ("X",) and options.ask_settings().max_new_tokens == 9
