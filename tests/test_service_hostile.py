"""`ragkv serve` against hostile but realistic clients, on loopback: one request can never fail
another's answer, outsiders cannot grow the metrics or make the server read past its body cap,
clients that leave free their rows, a full server answers 503 + Retry-After, and shutdown
always works. Every loop here is bounded in count; waits are on events, not on time."""

from __future__ import annotations

import json
import random
import select
import shutil
import signal
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

import ragkv
from ragkv.core.config import ModelSettings
from tests.conftest import QUESTIONS, running_server

pytestmark = pytest.mark.slow  # a real `ragkv serve`

LONG = 1000  # max_tokens of a request that would run for thousands of steps if nobody cut it


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_store, corpus):
    root = tmp_path_factory.mktemp("hostile")
    store, docs = root / "store", root / "docs"
    shutil.copytree(tiny_store, store)
    shutil.copytree(corpus, docs)
    with running_server(store, "--max-queue", "4", "--max-batch", "4", "--max-tokens-cap", str(LONG)) as (base, server):
        yield base, store, docs, server


def _chat(base: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(f"{base}/v1/chat/completions", json=body, timeout=600, **kwargs)


def _metric(base: str, name: str) -> float:
    text = httpx.get(f"{base}/metrics").text
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith(name + " ") or line.startswith(name + "{")
    )


def _question(i: int = 0, **extra) -> dict:
    return {"messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}], **extra}


def _send_raw(base: str, head: bytes, body: bytes = b"") -> socket.socket:
    host, port = base.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(head + body)
    return sock


def _post_head(path: str, extra: str) -> bytes:
    return f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{extra}\r\n".encode()


def test_a_huge_seed_is_a_400_and_the_running_stream_finishes(served):
    base = served[0]
    events = []

    def stream():
        with httpx.stream(
            "POST", f"{base}/v1/chat/completions", json=_question(0, stream=True, max_tokens=64), timeout=600
        ) as reply:
            events.extend(line for line in reply.iter_lines() if line.startswith("data: "))

    reader = threading.Thread(target=stream)
    reader.start()
    bad = _chat(base, _question(1, temperature=0.5, seed=10**40))
    reader.join()
    assert bad.status_code == 400 and "seed" in bad.json()["error"]["message"]
    assert events[-1] == "data: [DONE]" and '"finish_reason": "length"' in events[-2]
    assert _chat(base, _question(2, temperature=0.5, seed=2**64 - 1, max_tokens=4)).status_code == 200


def test_metrics_count_route_templates_not_raw_paths(served):
    base = served[0]
    rng = random.Random(0)
    for _ in range(300):
        assert httpx.get(f"{base}/{rng.getrandbits(64):x}/x").status_code == 404
    lines = [line for line in httpx.get(f"{base}/metrics").text.splitlines() if line.startswith("ragkv_requests_total")]
    assert 1 <= len(lines) <= 12, lines  # a few routes x statuses, however many paths were asked
    assert any('endpoint="unmatched"' in line and 'status="404"' in line for line in lines)


def test_a_chunked_body_past_the_cap_is_refused_as_it_arrives(served):
    base = served[0]
    sock = _send_raw(base, _post_head("/v1/chat/completions", "Transfer-Encoding: chunked\r\n"))
    chunk = b"x" * 65536
    for _ in range(24):  # 1.5 MiB of a body that claims to go on: the cap is 1 MiB
        if select.select([sock], [], [], 0)[0]:  # answered already: stop sending
            break
        try:
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        except (BrokenPipeError, ConnectionResetError):  # answered and closed while this was sending
            break
    reply = b""
    while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
        try:
            data = sock.recv(65536)  # answered while the client has not finished sending
        except ConnectionResetError:
            break
        if not data:
            break
        reply += data
    sock.close()
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413") and json.loads(body)["error"]["type"] == "request_too_large"
    assert httpx.get(f"{base}/healthz").json()["status"] == "ok"


def test_a_lone_surrogate_gets_the_json_error_shape(served):
    base = served[0]
    reply = httpx.post(
        f"{base}/v1/chat/completions",
        content=b'{"messages": [{"role": "user", "content": "x \\ud800"}]}',
        headers={"Content-Type": "application/json"},
        timeout=600,
    )
    assert reply.status_code == 400 and "UTF-8" in reply.json()["error"]["message"]


def test_streams_beyond_the_queue_get_503_with_retry_after(served):
    base = served[0]

    def stream(i: int) -> tuple[int, str, str]:
        with httpx.stream(
            "POST", f"{base}/v1/chat/completions", json=_question(i, stream=True, max_tokens=48), timeout=600
        ) as reply:
            return reply.status_code, reply.headers.get("retry-after", ""), "".join(reply.iter_text())

    with ThreadPoolExecutor(24) as pool:
        outcomes = list(pool.map(stream, range(24)))
    assert {status for status, _, _ in outcomes} == {200, 503}
    assert all(retry == "1" for status, retry, _ in outcomes if status == 503)
    assert all(
        text.endswith("data: [DONE]\n\n") and "server_busy" not in text for status, _, text in outcomes if status == 200
    )


def test_a_non_streaming_request_ends_with_its_client(served):
    base = served[0]
    cancelled, generated = (
        _metric(base, "ragkv_requests_cancelled_total"),
        _metric(base, "ragkv_tokens_generated_total"),
    )
    body = json.dumps(_question(0, max_tokens=LONG, no_repeat_ngram=0)).encode()
    sock = _send_raw(base, _post_head("/v1/chat/completions", f"Content-Length: {len(body)}\r\n"), body)
    while _metric(base, "ragkv_batch_running") < 1:  # decoding now (a client gone before that costs nothing)
        pass
    sock.close()  # gone before the answer
    # Until the server has noticed (cancelled) or, if it never does, the whole answer was made.
    while not (
        _metric(base, "ragkv_requests_cancelled_total") > cancelled
        or _metric(base, "ragkv_tokens_generated_total") >= generated + LONG // 2
    ):
        pass
    assert _metric(base, "ragkv_requests_cancelled_total") == cancelled + 1
    while _metric(base, "ragkv_batch_running") != 0:  # its row leaves at the next step
        pass
    assert _chat(base, _question(1, max_tokens=4)).status_code == 200


def test_64_clients_with_disconnects_during_a_reindex_fail_nothing_but_busy(served, tiny_llama):
    base, store, docs, _ = served
    leavers = set(random.Random(1).sample(range(64), 20))

    def client(i: int) -> tuple[int, str]:
        if i in leavers:  # leaves after its first token
            with httpx.stream(
                "POST", f"{base}/v1/chat/completions", json=_question(i, stream=True, max_tokens=200), timeout=600
            ) as reply:
                if reply.status_code != 200:
                    return reply.status_code, reply.headers.get("retry-after", "")
                next(line for line in reply.iter_lines() if '"content": "' in line and '"content": ""' not in line)
                return 200, "left"
        reply = _chat(base, _question(i, max_tokens=16, stream=False))
        return reply.status_code, reply.headers.get("retry-after", "") if reply.status_code == 503 else reply.text

    (docs / "notice.md").write_text("Notice: the office is closed on Friday.")
    indexer = threading.Thread(
        target=lambda: ragkv.ingest([docs], store, prune=True, model=ModelSettings(model=str(tiny_llama), device="cpu"))
    )
    with ThreadPoolExecutor(64) as pool:
        outcomes = pool.map(client, range(64))
        indexer.start()
        outcomes = list(outcomes)
    indexer.join()
    assert all(status in (200, 503) for status, _ in outcomes), [o for o in outcomes if o[0] not in (200, 503)][:2]
    assert all(extra == "1" for status, extra in outcomes if status == 503)
    assert any(status == 200 for status, _ in outcomes)
    while _metric(base, "ragkv_batch_running") != 0:
        pass
    reply = _chat(base, _question(2, max_tokens=4))
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"]


def test_the_guard_answers_503_with_retry_after_past_its_in_flight_limit_but_lets_probes_through():
    """The guard alone, in one event loop: two requests held in the app, a third refused with
    ragkv's 503 (uvicorn's own limit would answer a bare one, with no Retry-After)."""
    import asyncio

    from ragkv.serve.guard import RequestGuard

    async def scenario() -> list[httpx.Response]:
        held, release = asyncio.Semaphore(0), asyncio.Event()

        async def app(scope, receive, send) -> None:
            if scope["path"] == "/slow":
                held.release()
                await release.wait()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})

        guarded = RequestGuard(app, max_body_bytes=100, max_in_flight=2)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=guarded), base_url="http://x") as client:
            slow = [asyncio.create_task(client.get("/slow")) for _ in range(2)]
            for _ in slow:
                await held.acquire()
            refused, probe = await client.get("/other"), await client.get("/healthz")
            release.set()
            answered = await asyncio.gather(*slow)
            return [refused, probe, *answered, await client.get("/other")]

    refused, probe, *answered, after = asyncio.run(scenario())
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["type"] == "server_busy"
    assert probe.status_code == 200
    assert [reply.status_code for reply in answered] == [200, 200]
    assert after.status_code == 200  # the count went back down


def test_sigterm_stops_the_server_mid_stream(served):
    """Runs last: it stops the module's server."""
    base, _, _, server = served
    with httpx.stream(
        "POST",
        f"{base}/v1/chat/completions",
        json=_question(0, stream=True, max_tokens=LONG, no_repeat_ngram=0),
        timeout=600,
    ) as reply:
        next(line for line in reply.iter_lines() if '"content": "' in line and '"content": ""' not in line)
        server.send_signal(signal.SIGTERM)
        # A hang guard, not a timing: a clean server ends within its grace period (uvicorn re-raises the signal).
        assert server.wait(timeout=600) in (0, -signal.SIGTERM)
