"""The dashboard in a real browser: headless Chromium (Debian's `chromium`, driven by
Playwright) against a real `ragkv serve` on the sample store (the bundled SmolLM2). A key without
filters sees every document, asks in the playground (the answer streams, its sources show their
text and `cached_tokens`) and gets charts; a key whose filter admits the runbooks only sees those
documents, its answers' sources among them, and no chart.
No request leaves the server. Screenshots go to $RAGKV_SCREENSHOTS (docs/images/ holds the last
ones) or the test's temporary folder. Without Chromium or Playwright the test skips, saying so."""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import pytest

from ragkv.serve.api_keys import key_digest
from ragkv.store import open_snapshot
from tests.conftest import running_server

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [
    pytest.mark.slow,  # a server, a browser
    pytest.mark.skipif(
        not CHROMIUM or importlib.util.find_spec("playwright") is None,
        reason="no headless browser: apt-get install chromium, and pip install playwright",
    ),
]

ADMIN, RUNBOOKS = "key-admin-0001", "key-runbooks-0002"


def keys_file(path: Path) -> Path:
    path.write_text(
        f'[[keys]]\ntenant = "admin"\nsha256 = "{key_digest(ADMIN).hex()}"\n'
        f'[[keys]]\ntenant = "runbooks"\nsha256 = "{key_digest(RUNBOOKS).hex()}"\nfilters = ["path=runbooks/*"]\n'
    )
    return path


def use_key(page, key: str, documents: int) -> None:
    page.fill("#key", key)
    page.click("#key-form button[type=submit]")
    page.wait_for_function(f"document.querySelector('#doc-count').textContent === '{documents:,}'")


def ask(page, question: str) -> None:
    page.fill("#question", question)
    page.fill("#max-tokens", "24")
    page.click("#ask-form button[type=submit]")
    page.wait_for_selector("#sources li blockquote")


def test_the_dashboard_in_a_headless_browser(sample_store, tmp_path):
    from playwright.sync_api import sync_playwright

    store = tmp_path / "store"  # a copy: the service logs its uses into the store it serves
    shutil.copytree(sample_store[0], store)
    with open_snapshot(store) as snapshot:
        documents = snapshot.catalog.documents.all()
    runbooks = {d for d, row in documents.items() if "/runbooks/" in row.source}
    others = set(documents) - runbooks
    shots = Path(os.environ.get("RAGKV_SCREENSHOTS") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    with running_server(store, "--keys", str(keys_file(tmp_path / "keys.toml"))) as (base, _):
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 1100})
            asked: list[str] = []
            page.on("request", lambda request: asked.append(request.url))
            page.goto(f"{base}/ui")

            use_key(page, ADMIN, len(documents))
            table = page.inner_text("#documents")
            assert all(doc_id in table for doc_id in documents)
            ask(page, "How do I rotate the API key?")
            assert page.inner_text("#answer").strip()
            assert page.inner_text("#cached").startswith("cached_tokens ")
            assert int(page.inner_text("#cached").split()[1]) > 0  # the context's KV came from the store
            assert "key" in page.inner_text("#sources").lower()  # a source shows its chunk's text
            page.wait_for_function("document.querySelectorAll('#chart-ttft rect').length > 0")  # drawn after a question
            page.wait_for_function("document.querySelectorAll('#chart-tokens path').length > 0")  # two points in
            assert "prefill" in page.inner_text("#stage-legend")
            page.screenshot(path=str(shots / "ui.png"), full_page=True)

            use_key(page, RUNBOOKS, len(runbooks))
            page.wait_for_selector("#charts-note", state="visible")  # the server-wide parts: 403, said
            ask(page, "How many days of annual leave do I get?")  # the handbook's, out of this key's reach
            seen = page.content()
            assert all(doc_id in seen for doc_id in runbooks)
            assert not [doc_id for doc_id in others if doc_id in seen]
            assert not page.query_selector_all("#chart-tokens path")
            page.screenshot(path=str(shots / "ui-filtered-key.png"), full_page=True)
            browser.close()
    assert asked and all(url.startswith(base) for url in asked), [u for u in asked if not u.startswith(base)]
