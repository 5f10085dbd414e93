"""Kill a real ingest with SIGKILL at random moments. Afterwards the store opens and verifies,
and re-running the ingest completes, computing only what the killed run had not sealed."""

from __future__ import annotations

import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from safetensors import safe_open

import ragkv
from ragkv.config import IngestSettings, ModelSettings
from ragkv.keys import KVKey
from store import open_snapshot, verify
from store.generations import read_current
from store.shards import shard_files
from tests.conftest import ROOT

SETTINGS = dict(chunk_tokens=48, batch_tokens=192, shard_bytes=48 * 1024)  # many batches, many small shards

INGEST = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r})
    import ragkv
    from pipelines.progress import Reporter
    from ragkv.config import IngestSettings, ModelSettings

    class Signal(Reporter):
        def stage(self, name, total, unit="chunks"):
            print("STAGE", name, flush=True)

    ragkv.ingest([{docs!r}], {store!r}, model=ModelSettings(model={model!r}, device="cpu", dtype="float32"),
                 settings=IngestSettings(**{settings!r}), reporter=Signal())
    print("DONE", flush=True)
""")


def write_corpus(folder: Path, num_docs: int, first: int = 0) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(first, first + num_docs):
        sentences = " ".join(
            f"Fact {j} about system {i}: component {i}-{j} restarts after {i + j} seconds." for j in range(14)
        )
        (folder / f"doc-{i:03d}.md").write_text(f"# System {i}\n\n{sentences}")


def ingest(docs: Path, store: Path, model: Path):
    return ragkv.ingest(
        [docs],
        store,
        model=ModelSettings(model=str(model), device="cpu", dtype="float32"),
        settings=IngestSettings(**SETTINGS),
    )


@pytest.fixture(scope="module")
def crash_setup(tmp_path_factory, tiny_llama):
    """A base store (10 documents), a bigger corpus (those plus 30 more), and the keys a clean
    ingest of the bigger corpus produces."""
    root = tmp_path_factory.mktemp("crash")
    write_corpus(root / "base-docs", 10)
    ingest(root / "base-docs", root / "base", tiny_llama)
    shutil.copytree(root / "base-docs", root / "docs")
    write_corpus(root / "docs", 30, first=10)
    shutil.copytree(root / "base", root / "reference")
    ingest(root / "docs", root / "reference", tiny_llama)
    with open_snapshot(root / "reference") as snap:
        reference_keys = {e.kv_key for e in snap.catalog.reports.all_entries()}
        num_documents = snap.catalog.reports.counts()["documents"]
    return root, reference_keys, num_documents


def sealed_but_unreferenced(store: Path) -> set[str]:
    """Entry names in shard files the published catalog does not reference."""
    referenced = set()
    if read_current(store) is not None:
        with open_snapshot(store, require_documents=False) as snap:
            referenced = snap.catalog.reports.shards()
    names = set()
    for shard in set(shard_files(store / "shards")) - referenced:
        with safe_open(str(store / "shards" / shard), framework="pt") as f:
            names |= set(f.keys())
    return names


def kill_trial(trial: int, crash_setup, tiny_llama, tmp_path) -> str:
    root, reference_keys, num_documents = crash_setup
    rng = random.Random(trial)
    fresh = trial % 5 == 4  # some trials kill the very first ingest of a store
    store = tmp_path / f"trial-{trial}"
    if not fresh:
        shutil.copytree(root / "base", store)
    script = INGEST.format(
        root=str(ROOT), docs=str(root / "docs"), store=str(store), model=str(tiny_llama), settings=SETTINGS
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    # After the models load, chunking and embedding take ~1.2 s and KV compute with ~100
    # shard seals and catalog commits ~0.7 s here. Aim most kills at the writing phase.
    wait_for = "STAGE KV" if rng.random() < 0.6 else "STAGE"
    while not (line := proc.stdout.readline()).startswith(wait_for):
        assert line, "the ingest ended before the stage the trial waits for"
    time.sleep(rng.uniform(0.0, 0.9 if wait_for == "STAGE KV" else 1.5))
    outcome = "killed" if proc.poll() is None else "finished first"
    proc.send_signal(signal.SIGKILL)
    proc.wait()

    if read_current(store) is not None:  # the store opens and verifies
        with open_snapshot(store, require_documents=False) as snap:
            report = verify(snap)
            assert report.ok, (trial, report.problems)
            assert snap.catalog.reports.counts()["documents"] in ({0, 10} if not fresh else {0}) | {num_documents}
    sealed = sealed_but_unreferenced(store) & reference_keys

    published = read_current(store) is not None and read_current(store) > (0 if fresh else 1)
    rerun = ingest(root / "docs", store, tiny_llama)  # completes, recomputing nothing sealed
    assert rerun.kv_adopted == len(sealed), trial
    with open_snapshot(store) as snap:
        assert verify(snap).ok
        assert snap.catalog.reports.counts()["documents"] == num_documents
        keys = {e.kv_key for e in snap.catalog.reports.all_entries()}
    assert keys == reference_keys, trial
    already = set() if fresh else _base_keys(root)
    if rerun.documents["unchanged"] == num_documents:  # the killed run had published
        assert rerun.kv_computed == 0
    else:
        chunk_keys = {k for k in reference_keys if not KVKey.from_string(k).is_prefix}
        assert rerun.kv_computed == len(chunk_keys - already - sealed), trial
    print(
        f"trial {trial}: {outcome} after {wait_for!r}; {'published' if published else 'not published'}, "
        f"{len(sealed)} sealed entries adopted, {rerun.kv_computed} computed on re-run"
    )
    return outcome


_BASE_KEYS: dict[Path, set[str]] = {}


def _base_keys(root: Path) -> set[str]:
    if root not in _BASE_KEYS:
        with open_snapshot(root / "base") as snap:
            _BASE_KEYS[root] = {e.kv_key for e in snap.catalog.reports.all_entries()}
    return _BASE_KEYS[root]


@pytest.mark.parametrize("trial", range(3))
def test_kill_nine_during_ingest(trial, crash_setup, tiny_llama, tmp_path):
    kill_trial(trial, crash_setup, tiny_llama, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(3600)  # ~20 trials of ~20 s each (the suite's default hang guard is per test)
def test_kill_nine_at_least_twenty_times(crash_setup, tiny_llama, tmp_path):
    outcomes = []
    for trial in range(3, 43):  # until 20 trials really killed a running ingest
        outcomes.append(kill_trial(trial, crash_setup, tiny_llama, tmp_path))
        if outcomes.count("killed") == 20:
            break
    assert outcomes.count("killed") == 20, outcomes
