"""`ragkv serve`'s dashboard without a browser: the page and its assets come from the package
and name nothing off the machine, the store panel and the charts' series hold what the service
knows, and the Grafana dashboard in docs/ charts only metrics the service exports. (A filtered
key's view: tests/test_tenants.py; the page in a real browser: tests/test_ui_browser.py.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

import ragkv
from ragkv.serve.api import ServeSettings
from ragkv.serve.service import build_app
from tests.conftest import CORPUS, QUESTIONS, ROOT

PAGE = ROOT / "ragkv" / "serve" / "ui"
GRAFANA = ROOT / "docs" / "grafana" / "ragkv.json"
SVG_NAMESPACE = "http://www.w3.org/2000/svg"  # a name, not an address: never fetched


@pytest.fixture(scope="module")
def client(tiny_store):
    with ragkv.open(tiny_store, device="cpu") as engine, TestClient(build_app(engine, ServeSettings())) as client:
        yield client


def test_the_page_and_its_assets_are_served_small_and_name_nothing_off_the_machine(client):
    page = client.get("/ui")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<script src="/ui/app.js">' in page.text and 'href="/ui/style.css"' in page.text
    for name in ("app.js", "style.css"):
        assert client.get(f"/ui/{name}").status_code == 200
    files = sorted(PAGE.iterdir())
    assert sum(f.stat().st_size for f in files) <= 300 * 1024  # the wheel grows by at most 300 KB
    for f in files:
        addresses = set(re.findall(r"(?:https?:)?//[\w.-]+\.[a-z]{2,}[^\s\"'`)]*", f.read_text())) - {SVG_NAMESPACE}
        assert not addresses, (f.name, addresses)


def test_the_store_panel_lists_every_document_with_its_chunks_and_their_stored_kv(client):
    store = client.get("/v1/ui/store").json()
    names = {d["doc_id"] for d in store["listed"]}
    assert store["documents"] == len(names) >= len(CORPUS) and not store["filtered"]
    assert store["chunks"] == sum(len(d["chunks"]) for d in store["listed"]) == store["chunks_stored"]
    assert all(c["stored"] and c["text"] for d in store["listed"] for c in d["chunks"])
    assert store["model"]["dtype"] == "float32" and store["embedder"] and "query" in store["embedder_prompts"]
    assert (
        store["choices"]["context"][0] == "span" and "approximate" in store["choices"]["mode"]
    )  # the API's default first
    figures = store["store"]
    assert figures["generation"] >= 1 and figures["shard_bytes"] > 0 and figures["index"]["type"] == "flat"


def test_the_series_counts_a_question_and_the_chunks_route_gives_its_sources_text(client):
    before = client.get("/v1/ui/series").json()["now"]
    body = {"messages": [{"role": "user", "content": QUESTIONS[0]}], "max_tokens": 4, "ragkv": {"top_k": 2}}
    answer = client.post("/v1/chat/completions", json=body).json()
    after = client.get(f"/v1/ui/series?since={before['t']}").json()
    last = after["now"]
    assert last["requests"] > before["requests"] and last["reused"] - before["reused"] > 0
    assert sum(last["ttft_buckets"].values()) > sum(before["ttft_buckets"].values())
    assert after["tenants"][""]["requests"] >= 1 and after["tenants"][""]["cached_tokens"] > 0
    kept = client.get("/v1/ui/series").json()["points"]  # the sampler's, one every 5 s since the start
    assert kept and all(
        p["t"] > kept[-1]["t"] for p in client.get(f"/v1/ui/series?since={kept[-1]['t']}").json()["points"]
    )
    ids = [s["chunk_id"] for s in answer["ragkv"]["sources"]]
    texts = client.post("/v1/ui/chunks", json={"chunk_ids": ids}).json()["chunks"]
    assert set(texts) == {str(i) for i in ids} and all(texts.values())


def test_the_grafana_dashboard_charts_only_metrics_the_service_exports(client):
    client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    exported = {
        line.split("{")[0].split(" ")[0]
        for line in client.get("/metrics").text.splitlines()
        if line.startswith("ragkv_")
    }
    dashboard = json.loads(GRAFANA.read_text())
    charted = {
        name
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
        for name in re.findall(r"\bragkv_\w+", target["expr"])
    }
    assert charted and charted <= exported, charted - exported
    assert len(dashboard["panels"]) >= 6 and dashboard["title"]
    scrape = (ROOT / "docs" / "grafana" / "prometheus.yml").read_text()
    assert "/metrics" in scrape and "8000" in scrape


def test_the_page_costs_no_key_and_names_no_data(client, tmp_path: Path):
    html = client.get("/ui").text
    assert all(name not in html for name in CORPUS)  # the shell holds no data: the JSON routes do
