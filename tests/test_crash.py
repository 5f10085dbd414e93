"""Kill a real ingest with SIGKILL at random moments. Afterwards the store opens and verifies,
and re-running the ingest completes, computing only what the killed run had not sealed."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import ragkv
from ragkv.core.config import IngestSettings, ModelSettings
from ragkv.core.keys import KVKey
from ragkv.store import open_snapshot, verify
from ragkv.store.generations import read_current
from ragkv.store.kv.shards import shard_files
from tests.conftest import ROOT, computed_kv_of

pytestmark = pytest.mark.slow  # kill -9 trials of real ingests

SETTINGS = dict(chunk_tokens=48, batch_tokens=192, shard_bytes=48 * 1024)  # many batches, many small shards

# One ingest as a script of its own (tests/test_scaleout.py kills it while it uploads to S3).
INGEST = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r})
    import ragkv
    from ragkv.pipelines.progress import Reporter
    from ragkv.core.config import IngestSettings, ModelSettings

    class Signal(Reporter):
        def stage(self, name, total, unit="chunks"):
            print("STAGE", name, flush=True)

    ragkv.ingest([{docs!r}], {store!r}, model=ModelSettings(model={model!r}, device="cpu", dtype="float32"),
                 settings=IngestSettings(**{settings!r}), reporter=Signal())
    print("DONE", flush=True)
""")

# Each trial's ingest is a process of its own, killed with SIGKILL. It is forked from a process
# that has already imported torch, transformers and ragkv (and started no thread), so a trial
# does not pay ~4 s of imports before its ingest starts: what is killed is the same real ingest.
FORKS = textwrap.dedent("""
    import json, os, signal, sys
    sys.path.insert(0, {root!r})
    import ragkv, sentence_transformers, torch, transformers  # what every trial would import
    from ragkv.pipelines.progress import Reporter
    from ragkv.core.config import IngestSettings, ModelSettings

    class Signal(Reporter):
        def stage(self, name, total, unit="chunks"):
            print("STAGE", name, flush=True)

        def advance(self, count=1, tokens=0):
            print("ADVANCE", flush=True)

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # exited trials are reaped at once
    for line in sys.stdin:
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:  # the trial: its prints go to the FIFO its test reads
            os.dup2(os.open(job["out"], os.O_WRONLY), 1)
            sys.stdout = os.fdopen(1, "w")
            ragkv.ingest([job["docs"]], job["store"],
                         model=ModelSettings(model=job["model"], embedder=job["embedder"], device="cpu",
                                             dtype="float32"),
                         settings=IngestSettings(**job["settings"]), reporter=Signal())
            print("DONE", flush=True)
            os._exit(0)
        print(pid, flush=True)
""")


@pytest.fixture(scope="module")
def forks():
    """The process trials are forked from (see FORKS): write a job line, read the trial's pid."""
    proc = subprocess.Popen(
        [sys.executable, "-c", FORKS.format(root=str(ROOT))], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    yield proc
    proc.stdin.close()
    proc.wait()


def write_corpus(folder: Path, num_docs: int, first: int = 0) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(first, first + num_docs):
        sentences = " ".join(
            f"Fact {j} about system {i}: component {i}-{j} restarts after {i + j} seconds." for j in range(14)
        )
        (folder / f"doc-{i:03d}.md").write_text(f"# System {i}\n\n{sentences}")


def ingest(docs: Path, store: Path, model: Path, embedder: Path):
    return ragkv.ingest(
        [docs],
        store,
        model=ModelSettings(model=str(model), embedder=str(embedder), device="cpu", dtype="float32"),
        settings=IngestSettings(**SETTINGS),
    )


def tiny_embedder(folder: Path) -> Path:
    """The bundled MiniLM's tokenizer and pooling over one random encoder layer (seeded): what
    the kill trials embed with. They test the store's writes, not the vectors; each trial and
    its re-run embed 40 documents, ~5x faster so (0.06 s against 0.35 s for 200 chunks)."""
    from sentence_transformers import SentenceTransformer
    from transformers import BertConfig, BertModel

    from ragkv.core.config import DEFAULT_EMBEDDER
    from ragkv.model.embed import resolve_embedder_path

    model = SentenceTransformer(resolve_embedder_path(DEFAULT_EMBEDDER), device="cpu")
    config = BertConfig(**{**model[0].model.config.to_dict(), "num_hidden_layers": 1, "intermediate_size": 64})
    torch.manual_seed(0)
    model[0].model = BertModel(config).eval()
    model.save(str(folder))
    return folder


@pytest.fixture(scope="module")
def crash_setup(tmp_path_factory, tiny_llama):
    """A base store (10 documents), a bigger corpus (those plus 30 more), the keys a clean
    ingest of the bigger corpus produces, and the embedder they use."""
    root = tmp_path_factory.mktemp("crash")
    embedder = tiny_embedder(root / "embedder")
    write_corpus(root / "base-docs", 10)
    ingest(root / "base-docs", root / "base", tiny_llama, embedder)
    shutil.copytree(root / "base-docs", root / "docs")
    write_corpus(root / "docs", 30, first=10)
    shutil.copytree(root / "base", root / "reference")
    ingest(root / "docs", root / "reference", tiny_llama, embedder)
    with open_snapshot(root / "reference") as snap:
        reference_keys = {e.kv_key for e in snap.catalog.reports.all_entries()}
        num_documents = snap.catalog.reports.counts()["documents"]
    return root, reference_keys, num_documents, embedder


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


def kill_trial(trial: int, crash_setup, tiny_llama, tmp_path, forks) -> str:
    root, reference_keys, num_documents, embedder = crash_setup
    rng = random.Random(trial)
    fresh = trial % 5 == 4  # some trials kill the very first ingest of a store
    store = tmp_path / f"trial-{trial}"
    if not fresh:
        shutil.copytree(root / "base", store)
    out = tmp_path / f"trial-{trial}.out"
    os.mkfifo(out)
    job = {
        "docs": str(root / "docs"),
        "store": str(store),
        "model": str(tiny_llama),
        "embedder": str(embedder),
        "settings": SETTINGS,
        "out": str(out),
    }
    forks.stdin.write(json.dumps(job) + "\n")
    forks.stdin.flush()
    pid = int(forks.stdout.readline())
    # The kill comes after a random number of the ingest's own progress lines past a stage's
    # start (an event, not a time: a busy machine moves the kill nowhere). Over a base store the
    # ingest says: chunking 30 documents, embedding 4 batches, then 240 KV units (shard seals and
    # catalog commits among them), then its publish; fresh, 40, 5 and 310. Most kills aim at
    # the writing: anywhere in KV, or right after its last unit (the publish); the others at
    # chunking, embedding and early KV.
    wait_for = "STAGE KV" if rng.random() < 0.6 else "STAGE"
    events = rng.randrange(245 if wait_for == "STAGE KV" else 100)
    with open(out) as said:  # the trial's own output; its end is the trial's end
        while not (line := said.readline()).startswith(wait_for):
            assert line, "the ingest ended before the stage the trial waits for"
        for _ in range(events):
            if not (line := said.readline()) or line.startswith("DONE"):
                break
        with contextlib.suppress(ProcessLookupError):  # already ended
            os.kill(pid, signal.SIGKILL)
        ended = line.startswith("DONE") or "DONE" in said.read()  # read to the end: it is gone
        outcome = "finished first" if ended else "killed"

    if read_current(store) is not None:  # the store opens and verifies
        with open_snapshot(store, require_documents=False) as snap:
            report = verify(snap)
            assert report.ok, (trial, report.problems)
            assert snap.catalog.reports.counts()["documents"] in ({0, 10} if not fresh else {0}) | {num_documents}
    sealed = sealed_but_unreferenced(store) & reference_keys

    published = read_current(store) is not None and read_current(store) > (0 if fresh else 1)
    rerun = ingest(root / "docs", store, tiny_llama, embedder)  # completes, recomputing nothing sealed
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
        f"trial {trial}: {outcome} {events} lines after {wait_for!r}; {'published' if published else 'not published'}, "
        f"{len(sealed)} sealed entries adopted, {rerun.kv_computed} computed on re-run"
    )
    return outcome


_BASE_KEYS: dict[Path, set[str]] = {}


def _base_keys(root: Path) -> set[str]:
    if root not in _BASE_KEYS:
        with open_snapshot(root / "base") as snap:
            _BASE_KEYS[root] = {e.kv_key for e in snap.catalog.reports.all_entries()}
    return _BASE_KEYS[root]


@pytest.mark.timeout(3600)  # ~20 trials of ~5 s each (the suite's default hang guard is per test)
def test_kill_nine_at_least_twenty_times(crash_setup, tiny_llama, tmp_path, forks):
    outcomes = []
    for trial in range(40):  # until 20 trials really killed a running ingest
        outcomes.append(kill_trial(trial, crash_setup, tiny_llama, tmp_path, forks))
        if outcomes.count("killed") == 20:
            break
    assert outcomes.count("killed") == 20, outcomes


# -- a fold killed ----------------------------------------------------------------------------
FOLD = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {root!r})
    import ragkv.store.kv.writeback as writeback
    from ragkv.store.kv.pending import PendingArea

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    def then_die(function):
        def wrapped(*args, **kwargs):
            function(*args, **kwargs)
            die()
        return wrapped

    point, deleted = {point!r}, []
    if point == "read":  # the pending objects read, nothing written
        writeback.read_objects = then_die(writeback.read_objects)
    if point == "commit":  # their KV sealed into a shard and its rows added, not published
        writeback.commit_computed = then_die(writeback.commit_computed)
    if point == "publish":  # the generation published, no object deleted
        writeback.FoldReport.delete_folded = die
    if point == "delete":  # one object deleted: a manifest, its shard not yet
        delete = PendingArea.delete
        PendingArea.delete = lambda area, name: die() if deleted else (deleted.append(name), delete(area, name))
    writeback.fold({store!r})
""")


@pytest.fixture(scope="module")
def fold_setup(tmp_path_factory, tiny_llama, corpus):
    """A store without chunk KV, and two readers' pending KV for it (the same two chunks, as
    computed by ingest) with their uses."""
    root = tmp_path_factory.mktemp("fold-crash")
    model = ModelSettings(model=str(tiny_llama), device="cpu", dtype="float32")
    ragkv.ingest([corpus], root / "full", model=model, settings=IngestSettings())
    ragkv.ingest([corpus], root / "lazy", model=model, settings=IngestSettings(precompute=0))
    batch, rows = computed_kv_of(root / "full")
    return root / "lazy", batch, rows


@pytest.mark.parametrize("point", ["read", "commit", "publish", "delete"])
def test_a_fold_killed_at_any_step_loses_nothing_and_counts_nothing_twice(point, fold_setup, tmp_path):
    """Kill -9 a fold at each of its steps: the store verifies as it is, and the next fold
    stores each pending key once and counts each use once."""
    from ragkv.store.kv.pending import PendingWriter
    from ragkv.store.kv.pending_hits import PendingHits
    from ragkv.store.kv.popularity import Use
    from ragkv.store.kv.writeback import fold

    lazy, batch, rows = fold_setup
    store = tmp_path / "store"
    shutil.copytree(lazy, store)
    for _ in range(2):  # two readers computed the same chunks and used them
        PendingWriter(store, pending_bytes=1 << 30).put(batch)
        hits = PendingHits(store)
        hits.record([Use(r.doc_id, r.chunk_index, "computed") for r in rows])
        hits.close()
    before = read_current(store)
    killed = subprocess.run([sys.executable, "-c", FOLD.format(root=str(ROOT), store=str(store), point=point)])
    assert killed.returncode == -signal.SIGKILL
    assert read_current(store) == before + (point in ("publish", "delete"))
    with open_snapshot(store) as snap:
        assert verify(snap).ok
    report = fold(store)
    assert report.stored == (0 if point in ("publish", "delete") else len(batch))
    with open_snapshot(store) as snap:
        assert verify(snap).ok
        stored = {e.kv_key for e in snap.catalog.reports.all_entries()}
        assert {b.kv_key for b in batch} <= stored
        counts = snap.catalog.usage.chunk_hits()
        assert [counts[(r.doc_id, r.chunk_index)].misses for r in rows] == [2, 2]  # each reader's use, once
    left = sorted(p.suffix for p in (store / "pending").iterdir())
    assert left == ([".safetensors"] if point == "delete" else [])  # its manifest went first: never folded
