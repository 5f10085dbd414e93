"""The ragkv connector inside a live vLLM (its CPU build, or CUDA): a matched request's first
token equals vLLM's own full prefill's, vLLM computes only the question's tokens, and an
unmatched request falls through untouched; loads before the forward and layer by layer; a
chunk the store lacks is saved from vLLM's blocks and served from the store next; uses land in
the hit log.

vLLM pins its own torch and transformers, so it lives in its own environment: point
RAGKV_VLLM_PYTHON at its python (`bash tests/vllm_env.sh .venv-vllm` makes one; the README's
test command and CI do). Without it these tests skip, saying so."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

import ragkv
from ragkv.core.config import AskSettings
from ragkv.core.keys import KVKey
from ragkv.kv import codec
from ragkv.store import open_snapshot, verify
from ragkv.store.kv.popularity import HITS_DIR
from tests import vllm_probe
from tests.conftest import ROOT, SAMPLE_DATA, free_port, run_cli

VLLM_PYTHON = os.environ.get("RAGKV_VLLM_PYTHON", "")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not VLLM_PYTHON,
        reason="no vLLM: set RAGKV_VLLM_PYTHON to a python that has vllm (bash tests/vllm_env.sh .venv-vllm)",
    ),
]
if VLLM_PYTHON and not Path(VLLM_PYTHON).is_file():  # named but missing: a broken setup must not pass as a skip
    raise RuntimeError(f"RAGKV_VLLM_PYTHON={VLLM_PYTHON} is not a file")
QUESTIONS = [
    "How do I rotate the API key?",
    "How many days of annual leave do I get?",
    "What happens when the database fails over?",
]


def probe(model: str, store: Path, runs: list, tmp_path: Path, **spec) -> dict:
    return vllm_probe.run(VLLM_PYTHON, model, store, {**spec, "runs": runs}, tmp_path, forked=True)


def run(name: str, ids, params=None, flush: bool = False) -> dict:
    return {"name": name, "ids": list(ids), "params": params, "flush": flush}


SKIP = {"ragkv": "skip"}


@pytest.mark.parametrize("layerwise", [False, True], ids=["before-forward", "layer-by-layer"])
def test_vllm_loads_the_stored_kv_and_prefills_only_the_question(sample_store, tmp_path, layerwise):
    store, _ = sample_store
    runs, held = [], {}
    with ragkv.open(store, device="cpu") as engine:
        model = engine.lm.facts.path
        for i, question in enumerate(QUESTIONS):
            answer = engine.ask(question, max_new_tokens=1, context="chunk")
            ((row, _),) = engine.retrieve(question)
            held[f"q{i}"] = len(engine.active.layout.prefix_ids) + len(row.token_ids)
            runs += [run(f"q{i}", answer.prompt_ids), run(f"q{i}-full", answer.prompt_ids, SKIP)]
        plain = engine.lm.tokenizer("Write one sentence about the sea.", add_special_tokens=False)["input_ids"]
        num_layers = engine.lm.model.config.num_hidden_layers
    runs += [run("plain", plain), run("plain-full", plain, SKIP)]
    result = probe(model, store, runs, tmp_path, layerwise=layerwise)
    runs, block = {r["name"]: r for r in result["runs"]}, result["block_size"]
    for name, num_held in held.items():
        matched, full = runs[name], runs[f"{name}-full"]
        assert matched["first_token"] == full["first_token"]
        token = str(full["first_token"])  # its log-probability: within float tolerance (KV from transformers)
        assert abs(matched["logprobs"][token] - full["logprobs"][token]) < 1e-3
        assert full["num_cached_tokens"] == 0
        # Whole blocks of what the store holds; vLLM computes the rest: the question and a partial block.
        assert matched["num_cached_tokens"] == num_held // block * block > 0
    assert runs["plain"]["num_cached_tokens"] == 0
    assert runs["plain"]["first_token"] == runs["plain-full"]["first_token"]
    # Layer by layer, every attention layer waited for its own layer's copy, once per load.
    assert result["layer_waits"] == (len(held) * num_layers if layerwise else 0)


@pytest.fixture(scope="module")
def lazy_sample_store(tmp_path_factory):
    """The sample corpus ingested with no chunk KV (--precompute 0): every chunk a miss."""
    store = tmp_path_factory.mktemp("lazy") / "kvstore"
    result = run_cli("ingest", SAMPLE_DATA, "--store", store, "--precompute", "0", "--device", "cpu")
    assert result.exit_code == 0, result.output
    return store


def test_vllm_stores_what_it_computes_and_logs_each_use(sample_store, lazy_sample_store, tmp_path):
    """A chunk the store lacks: vLLM prefills it, the connector saves exactly its token range
    through the write-back, and the next request loads it. The saved KV agrees with
    transformers' (float32), and ragkv's own engine answers from it token-identically."""
    from ragkv.core.config import AskSettings
    from ragkv.serve.api import ServeSettings
    from ragkv.serve.stores import layout_params

    full_store, _ = sample_store
    store = tmp_path / "store"
    shutil.copytree(lazy_sample_store, store)
    runs, held, keys = [], {}, set()
    with ragkv.open(store, device="cpu", weights=False) as engine:
        model = engine.lm.facts.path
        for i, question in enumerate(QUESTIONS):
            prompt = engine.prompt_for(question, AskSettings(top_k=1, context="chunk"))
            params = layout_params(prompt, ServeSettings())
            assert params["ragkv"]["write_back"]  # the lazy store holds no chunk: a miss
            held[f"q{i}"] = len(engine.active.layout.prefix_ids) + len(prompt.chunk_ids[0])
            keys.add(KVKey.for_chunk(engine.active.profile, prompt.chunk_ids[0]).to_string())  # ingest's key
            runs += [
                run(f"q{i}-miss", prompt.prompt_ids, params, flush=True),
                run(f"q{i}-hit", prompt.prompt_ids, params),
                run(f"q{i}-full", prompt.prompt_ids, SKIP),
            ]
        malformed = {"ragkv": {"chunks": [["x", 5]], "write_back": "yes"}}
        runs.append(run("malformed", prompt.prompt_ids, malformed))
    result = probe(model, store, runs, tmp_path, kv_role="kv_both")
    by_name, block = {r["name"]: r for r in result["runs"]}, result["block_size"]
    assert result["write_back"]["stored"] == len(QUESTIONS) and result["write_back"]["failures"] == 0
    for name, num_held in held.items():
        miss, hit, full = by_name[f"{name}-miss"], by_name[f"{name}-hit"], by_name[f"{name}-full"]
        assert miss["num_cached_tokens"] == len(engine.active.layout.prefix_ids) // block * block  # the prefix only
        assert hit["num_cached_tokens"] == num_held // block * block > miss["num_cached_tokens"]
        token = str(full["first_token"])
        assert miss["first_token"] == hit["first_token"] == full["first_token"]
        assert abs(hit["logprobs"][token] - full["logprobs"][token]) < 1e-3
    # A client's malformed params: served as a plain prompt, with one warning, the engine alive.
    assert by_name["malformed"]["first_token"] == by_name[f"q{len(QUESTIONS) - 1}-full"]["first_token"]
    assert "kv_transfer_params" in result["log"] and "write_back" in result["log"]

    with open_snapshot(store) as snapshot:
        assert verify(snapshot).ok
        assert snapshot.catalog.reports.counts()["kv_entries"] == 1 + len(keys)  # the prefix and each chunk asked about
    # Cross-engine agreement: vLLM's KV of each chunk against transformers' (ingest's) KV.
    with open_snapshot(full_store) as reference, open_snapshot(store) as ours:
        for key in keys:
            theirs, mine = reference.catalog.entries.entry(key), ours.catalog.entries.entry(key)
            assert theirs is not None  # the same key ingest gave the chunk
            want = codec.decode(
                reference.shards.read_parts(theirs.shard, theirs.tensor, theirs.checksum), torch.float32
            ).kv
            got = codec.decode(ours.shards.read_parts(mine.shard, mine.tensor, mine.checksum), torch.float32).kv
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    # Uses logged as ragkv's engine logs them: a computed miss, then store hits.
    uses = [json.loads(line) for path in (store / HITS_DIR).glob("*.jsonl") for line in path.read_text().splitlines()]
    sources = [u["src"] for u in uses]
    assert sources.count("computed") == len(QUESTIONS) and sources.count("store") == len(QUESTIONS)
    # ragkv's own engine answers from the KV vLLM stored, as from its own.
    with ragkv.open(store, device="cpu") as served, ragkv.open(full_store, device="cpu") as reference:
        for question in QUESTIONS:
            got = served.ask(question, max_new_tokens=12, context="chunk")
            want = reference.ask(question, max_new_tokens=12, context="chunk")
            assert got.stats.kv_source == "store" and got.token_ids == want.token_ids


def test_vllm_learns_every_missing_chunk_of_a_span(tmp_path):
    """A span store without chunk KV (--precompute 0): a prompt holding a span from its start
    has vLLM prefill it, and the connector saves each of its chunks under ingest's chained
    key, equal to ingest's KV within cross-engine tolerance; the next request loads them all,
    and ragkv's own engine answers from them token-identically."""
    from ragkv.serve.api import ServeSettings
    from ragkv.serve.stores import layout_params

    spans_args = ["--chunk-tokens", "64", "--span-tokens", "512", "--device", "cpu"]
    full, store = tmp_path / "full", tmp_path / "lazy"
    for path, extra in ((full, []), (store, ["--precompute", "0"])):
        result = run_cli("ingest", SAMPLE_DATA, "--store", path, *spans_args, *extra)
        assert result.exit_code == 0, result.output
    span = AskSettings(top_k=1, context="span", max_new_tokens=8)
    with ragkv.open(store, device="cpu", weights=False) as engine:
        model = engine.lm.facts.path
        prompt = engine.prompt_for(QUESTIONS[2], span)
        rows = [row for row, _ in prompt.retrieved]
        params = layout_params(prompt, ServeSettings())
        held = len(prompt.prompt_ids) - len(engine.active.layout.question_ids(engine.lm.tokenizer, QUESTIONS[2]))
    assert len(rows) >= 2 and params["ragkv"]["write_back"]  # a span's later chunk, and nothing stored
    runs = [
        run("miss", prompt.prompt_ids, params, flush=True),
        run("hit", prompt.prompt_ids, params),
        run("full", prompt.prompt_ids, SKIP),
    ]
    result = probe(model, store, runs, tmp_path, kv_role="kv_both")
    by_name, block = {r["name"]: r for r in result["runs"]}, result["block_size"]
    assert result["write_back"]["stored"] == len(rows) and result["write_back"]["failures"] == 0
    assert by_name["hit"]["num_cached_tokens"] == held // block * block > by_name["miss"]["num_cached_tokens"]
    assert by_name["miss"]["first_token"] == by_name["hit"]["first_token"] == by_name["full"]["first_token"]
    with open_snapshot(full) as reference, open_snapshot(store) as ours:
        assert verify(ours).ok
        wanted = {
            r.chunk_id: r
            for r in reference.catalog.entries.context_rows(
                reference.catalog.entries.profiles()[0].profile_id, [r.chunk_id for r in rows]
            )
        }
        got_rows = ours.catalog.entries.context_rows(
            ours.catalog.entries.profiles()[0].profile_id, [r.chunk_id for r in rows]
        )
        for row in got_rows:
            theirs, mine = wanted[row.chunk_id].entry, row.entry
            assert mine is not None and mine.kv_key == theirs.kv_key  # the key ingest chained through the span
            want = codec.decode(
                reference.shards.read_parts(theirs.shard, theirs.tensor, theirs.checksum), torch.float32
            ).kv
            got = codec.decode(ours.shards.read_parts(mine.shard, mine.tensor, mine.checksum), torch.float32).kv
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    with ragkv.open(store, device="cpu") as served, ragkv.open(full, device="cpu") as reference:
        got, want = served.ask(QUESTIONS[2], span), reference.ask(QUESTIONS[2], span)
        assert got.stats.kv_source == "store" and got.token_ids == want.token_ids


def test_serve_engine_vllm_answers_with_the_store_kv(sample_store, tmp_path):
    store, _ = sample_store
    served = tmp_path / "store"
    shutil.copytree(store, served)  # the connector logs chunk uses into its store
    shutil.rmtree(served / HITS_DIR, ignore_errors=True)  # uses other tests logged in the shared sample store
    port, vllm_port = free_port(), free_port()
    from ragkv.serve.api_keys import key_digest

    keys = tmp_path / "keys.toml"  # every request carries a tenant, so the front salts vLLM's prefix cache
    keys.write_text(
        f'[[keys]]\ntenant = "a"\nsha256 = "{key_digest("key-a").hex()}"\n'
        f'[[keys]]\ntenant = "b"\nsha256 = "{key_digest("key-b").hex()}"\nfilters = ["path!=*rotate-api-key.md"]\n'
    )
    auth = {"Authorization": "Bearer key-a"}
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ragkv",
            "serve",
            "--store",
            str(served),
            "--port",
            str(port),
            "--engine",
            "vllm",
            "--vllm-python",
            VLLM_PYTHON,
            "--vllm-port",
            str(vllm_port),
            "--keys",
            str(keys),
            # On the CPU build --gpu-memory-utilization is the share of the NUMA node's memory vLLM must find free
            # at start (0.92 by default): a busy test machine may not have it.
            "--vllm-args",
            "--enforce-eager --max-model-len 2048 --enable-prompt-tokens-details --gpu-memory-utilization 0.5",
        ],
        cwd=ROOT,
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        said = []
        while not (said and "ragkv serving" in said[-1]):  # the event, not a number of seconds
            said.append(server.stderr.readline())
            if not said[-1]:
                pytest.fail(f"the server did not start: {''.join(said[-30:])}")
        body = {"model": "ragkv", "messages": [{"role": "user", "content": QUESTIONS[0]}], "max_tokens": 8}
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, headers=auth, timeout=600).json()
        assert reply["choices"][0]["message"]["content"].strip()
        assert reply["ragkv"]["sources"][0]["source"].endswith("rotate-api-key.md")
        assert reply["usage"]["prompt_tokens"] == reply["ragkv"]["prompt_tokens"]
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        streamed = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions", json={**body, "stream": True}, headers=auth, timeout=600
        ).text
        deltas = [
            json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {") and '"delta"' in line
        ]
        text = "".join(d["choices"][0]["delta"].get("content") or "" for d in deltas)
        assert text == reply["choices"][0]["message"]["content"] and deltas[-1]["ragkv"]["sources"]
        two_turns = {
            **body,
            "messages": [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": QUESTIONS[0]},
            ],
        }
        refused = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=two_turns, headers=auth, timeout=600)
        assert refused.status_code == 400 and "one question per request" in refused.json()["error"]["message"]
        # The front named the chunks: vLLM's scheduler logged each use, a hit, in the store's hit log.
        uses = [
            json.loads(line) for path in (served / HITS_DIR).glob("*.jsonl") for line in path.read_text().splitlines()
        ]
        assert [(u["doc"], u["src"]) for u in uses] == [(reply["ragkv"]["sources"][0]["doc_id"], "store")] * 2
        # Tenant b's scope leaves the document out: the front retrieves another for it.
        scoped = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json=body,
            headers={"Authorization": "Bearer key-b"},
            timeout=600,
        ).json()
        assert scoped["ragkv"]["sources"] and not scoped["ragkv"]["sources"][0]["source"].endswith("rotate-api-key.md")
        unkeyed = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=600)
        assert unkeyed.status_code == 401
    finally:
        server.terminate()
        server.wait()


def test_ingest_on_vllm_with_spans_under_a_budget_builds_what_local_ingest_builds(tmp_path):
    """`ingest --engine vllm --span-tokens --kv-budget`: the budget's plan is made as the local
    engine makes it, and vLLM computes each planned span from its start: the same entries under
    the same chained keys, every span a prefix of itself, answers token-identical (float32)."""
    args = ["--chunk-tokens", "64", "--span-tokens", "512", "--device", "cpu", "--json"]
    local, ours = tmp_path / "local", tmp_path / "vllm"
    probe_store = tmp_path / "all"
    assert run_cli("ingest", SAMPLE_DATA, "--store", probe_store, *args).exit_code == 0
    with open_snapshot(probe_store) as snapshot:
        prefix = snapshot.catalog.reports.prefix_bytes()
        budget = str(prefix + (snapshot.catalog.reports.kv_bytes() - prefix) // 2)
    reports = {}
    for store, engine in ((local, ["--engine", "ragkv"]), (ours, ["--engine", "vllm", "--vllm-python", VLLM_PYTHON])):
        result = run_cli("ingest", SAMPLE_DATA, "--store", store, "--kv-budget", budget, *engine, *args)
        assert result.exit_code == 0, result.output
        reports[store] = json.loads(result.stdout)
    assert reports[ours]["kv_computed"] == reports[local]["kv_computed"] > 0
    assert reports[ours]["kv_deferred"] == reports[local]["kv_deferred"] > 0
    with open_snapshot(local) as theirs, open_snapshot(ours) as mine:
        assert verify(mine).ok
        keys = [{e.kv_key for e in snap.catalog.reports.all_entries()} for snap in (theirs, mine)]
        assert keys[0] == keys[1]
    span = AskSettings(top_k=1, context="span", max_new_tokens=12)
    with ragkv.open(ours, device="cpu", write_back=False) as served, ragkv.open(local, device="cpu") as reference:
        for question in QUESTIONS:
            assert served.ask(question, span).token_ids == reference.ask(question, span).token_ids


def test_vllm_on_an_s3_store_ingests_and_learns_through_the_fold(sample_store, s3_env, tmp_path, monkeypatch):
    """On S3: `ingest --engine vllm` builds the store local ingest builds (vLLM's process is its
    one writer): the same entries under the same keys, answers from them token-identical
    (float32; into a local folder, the span test above). A vLLM replica with the connector, on
    a store without chunk KV, never takes the lock: the KV it computes on each miss and the
    uses it logs are left under pending/, the published store unchanged. A second replica, on
    another machine, loads that pending KV instead of computing it again (first tokens equal to
    vLLM's own full prefill's), and `ragkv fold` stores each chunk once, with both replicas'
    uses."""
    from ragkv.serve.api import ServeSettings
    from ragkv.serve.stores import layout_params
    from tests import s3server
    from tests.conftest import fresh_home

    full_store, local_report = sample_store
    built, lazy = "s3://ragkv/vllm-built", "s3://ragkv/vllm-lazy"
    result = run_cli(
        "ingest", SAMPLE_DATA, "--store", built, "--engine", "vllm", "--vllm-python", VLLM_PYTHON, "--json"
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["engine"] == "vllm" and report["kv_deferred"] == 0 and report["tokens_per_s"] > 0
    assert report["kv_computed"] == local_report["kv_computed"]  # every chunk (the prefix is computed here)
    with open_snapshot(built) as ours, open_snapshot(full_store) as reference:
        assert verify(ours).ok
        keys = [{e.kv_key for e in snap.catalog.reports.all_entries()} for snap in (ours, reference)]
        assert keys[0] == keys[1]
    with ragkv.open(built, device="cpu", write_back=False) as served, ragkv.open(full_store, device="cpu") as local:
        for question in QUESTIONS:
            got = served.ask(question, max_new_tokens=12)
            assert got.stats.kv_source == "store"
            assert got.token_ids == local.ask(question, max_new_tokens=12).token_ids

    assert run_cli("ingest", SAMPLE_DATA, "--store", lazy, "--precompute", "0").exit_code == 0
    prompts = {}
    with ragkv.open(lazy, device="cpu", weights=False) as engine:
        model, generation = engine.lm.facts.path, engine.snapshot.generation
        prefix_len = len(engine.active.layout.prefix_ids)
        for i, question in enumerate(QUESTIONS):
            prompt = engine.prompt_for(question, AskSettings(top_k=1, context="chunk"))
            params = layout_params(prompt, ServeSettings())
            prompts[f"q{i}"] = (prompt.prompt_ids, params, prefix_len + len(prompt.chunk_ids[0]))

    def replica(suffix: str, flush: bool, work: Path) -> tuple[dict, int]:
        runs = []
        for name, (ids, params, _) in prompts.items():
            runs += [run(f"{name}-{suffix}", ids, params, flush=flush), run(f"{name}-full", ids, SKIP)]
        work.mkdir()
        result = probe(model, lazy, runs, work, kv_role="kv_both")
        return {r["name"]: r for r in result["runs"]}, result["block_size"]

    def pending_objects() -> list[str]:
        return [k for k in s3server.objects(s3_env["fs"], "vllm-lazy") if k.startswith("pending/")]

    first, block = replica("miss", True, tmp_path / "first")
    left = pending_objects()
    manifests = [k for k in left if k.endswith(".json")]
    assert manifests and [k for k in left if k.endswith(".hits.jsonl")]  # the KV and the uses, as objects
    with open_snapshot(lazy) as snapshot:  # nothing published by the replica
        assert snapshot.generation == generation and snapshot.catalog.reports.counts()["kv_entries"] == 1

    fresh_home(tmp_path / "another-machine", monkeypatch)
    second, _ = replica("hit", False, tmp_path / "second")
    for name, (_, _, num_held) in prompts.items():
        miss, hit, full = first[f"{name}-miss"], second[f"{name}-hit"], second[f"{name}-full"]
        assert miss["num_cached_tokens"] == prefix_len // block * block  # the prefix only
        assert hit["num_cached_tokens"] == num_held // block * block > miss["num_cached_tokens"]  # and the chunk
        assert miss["first_token"] == hit["first_token"] == full["first_token"]
        token = str(full["first_token"])
        assert abs(hit["logprobs"][token] - full["logprobs"][token]) < 1e-3
    assert [k for k in pending_objects() if k.endswith(".json")] == manifests  # nothing computed twice

    folded = run_cli("fold", "--store", lazy, "--json")
    assert folded.exit_code == 0, folded.output
    folded = json.loads(folded.stdout)
    assert folded["stored"] == len(QUESTIONS) and folded["uses_folded"] == 2 * len(QUESTIONS)
    assert not pending_objects()
    with ragkv.open(lazy, device="cpu", write_back=False) as served, ragkv.open(full_store, device="cpu") as local:
        for question in QUESTIONS:  # the KV vLLM computed, folded: ragkv's engine answers from it
            got = served.ask(question, max_new_tokens=12, context="chunk")
            assert got.stats.kv_source == "store"
            assert got.token_ids == local.ask(question, max_new_tokens=12, context="chunk").token_ids


SLIDING = ["gemma3 (sliding + full)", "gpt-oss (sliding + full, sinks)"]


@pytest.mark.parametrize("family", SLIDING)
def test_vllm_loads_and_saves_a_sliding_window_model_through_the_store(family, corpus, tmp_path):
    """Sliding layers mixed with full ones (Gemma 3; gpt-oss, with attention sinks), windows of
    12 tokens, shorter than a chunk. vLLM loads a stored chunk up to its entry's end (the store
    keeps of a sliding layer each entry's last `window - 1` tokens, all the next token reads)
    and prefills only the question, to the first token of its own full prefill. A chunk the store
    lacks is saved from vLLM's blocks in the windowed form ingest writes, agreeing with ingest's,
    and ragkv's own engine answers from it as from its own."""
    from ragkv.serve.api import ServeSettings
    from ragkv.serve.stores import layout_params
    from tests import families
    from tests.conftest import build_store

    folder = families.build(family, tmp_path / "model", head_dim=32)  # the smallest vLLM's CPU attention takes
    full, store = tmp_path / "full", tmp_path / "lazy"
    build_store(corpus, full, str(folder), chunk_tokens=24)
    build_store(corpus, store, str(folder), chunk_tokens=24, precompute=0)
    runs, held, keys = [], {}, set()
    with ragkv.open(full, device="cpu") as engine:
        for i, question in enumerate(QUESTIONS[:2]):
            prompt = engine.prompt_for(question, AskSettings(top_k=1, context="chunk"))
            held[f"q{i}"] = len(engine.active.layout.prefix_ids) + len(prompt.chunk_ids[0])
            keys.add(KVKey.for_chunk(engine.active.profile, prompt.chunk_ids[0]).to_string())
            runs += [run(f"q{i}", prompt.prompt_ids), run(f"q{i}-full", prompt.prompt_ids, SKIP)]
    result = probe(str(folder), full, runs, tmp_path, kv_role="kv_consumer", max_model_len=1024)
    # vLLM's hybrid allocator on (the connector supports it): the sliding layer in a group of its own
    assert result["hybrid_allocator"], result["log"][-2000:]
    assert sorted(result["kv_cache_groups"], key=str) == sorted([[None, 1], [families.WINDOW, 1]], key=str)
    by_name = {r["name"]: r for r in result["runs"]}
    for name, num_held in held.items():
        matched, plain = by_name[name], by_name[f"{name}-full"]
        assert matched["num_cached_tokens"] == num_held  # to the chunk's entry's end, not a block's
        assert matched["first_token"] == plain["first_token"]
        token = str(plain["first_token"])
        assert abs(matched["logprobs"][token] - plain["logprobs"][token]) < 1e-3

    runs = []
    with ragkv.open(store, device="cpu", weights=False) as engine:
        for i, question in enumerate(QUESTIONS[:2]):
            prompt = engine.prompt_for(question, AskSettings(top_k=1, context="chunk"))
            params = layout_params(prompt, ServeSettings())
            runs += [run(f"q{i}-miss", prompt.prompt_ids, params, flush=True), run(f"q{i}-hit", prompt.prompt_ids)]
    result = probe(str(folder), store, runs, tmp_path, kv_role="kv_both", max_model_len=1024)
    assert result["write_back"]["stored"] == 2 and result["write_back"]["failures"] == 0
    by_name = {r["name"]: r for r in result["runs"]}
    assert all(by_name[f"q{i}-hit"]["num_cached_tokens"] == held[f"q{i}"] for i in range(2))
    with open_snapshot(full) as reference, open_snapshot(store) as ours:
        assert verify(ours).ok
        for key in keys:
            theirs, mine = reference.catalog.entries.entry(key), ours.catalog.entries.entry(key)
            want_parts = reference.shards.read_parts(theirs.shard, theirs.tensor, theirs.checksum)
            got_parts = ours.shards.read_parts(mine.shard, mine.tensor, mine.checksum)
            assert set(got_parts) == set(want_parts)  # windowed as ingest stores it
            for part, want in want_parts.items():
                torch.testing.assert_close(got_parts[part].float(), want.float(), rtol=1e-3, atol=1e-3)
    with ragkv.open(store, device="cpu") as served, ragkv.open(full, device="cpu") as reference:
        for question in QUESTIONS[:2]:
            got = served.ask(question, max_new_tokens=8, context="chunk")
            want = reference.ask(question, max_new_tokens=8, context="chunk")
            assert got.stats.kv_source == "store" and got.token_ids == want.token_ids


RECURRENT = {  # family -> config fields for heads of 32, the smallest vLLM's CPU attention takes
    "nemotron-h (Mamba2 + attention + MLP layers)": {"head_dim": 32},
    "falcon-h1 (Mamba2 beside attention in every layer)": {"head_dim": 32},
    "granite 4 hybrid (Mamba2 + attention)": {"hidden_size": 128, "head_dim": 32, "mamba_n_heads": 8},
}


@pytest.mark.parametrize("family", RECURRENT)
def test_vllm_loads_a_mamba2_hybrid_from_the_stored_kv_and_state(family, corpus, tmp_path):
    """Mamba2 layers beside attention (Nemotron-H, Granite 4; Falcon-H1, both in every layer), run
    by vLLM's CPU build. vLLM loads a stored chunk's attention KV and each Mamba2 layer's state after it
    (conv window and state matrix, into the request's state block), and prefills only the
    question, to the first token of its own full prefill. The connector saves no chunk of these
    (a state at a chunk's end is gone by the end of the step), so a miss stays a miss."""
    from ragkv.serve.api import ServeSettings
    from ragkv.serve.stores import layout_params
    from tests import families
    from tests.conftest import build_store

    folder = families.build(family, tmp_path / "model", **RECURRENT[family])
    full, lazy = tmp_path / "full", tmp_path / "lazy"
    build_store(corpus, full, str(folder), chunk_tokens=24)
    build_store(corpus, lazy, str(folder), chunk_tokens=24, precompute=0)
    runs, held = [], {}
    with ragkv.open(full, device="cpu") as engine:
        for i, question in enumerate(QUESTIONS[:2]):
            prompt = engine.prompt_for(question, AskSettings(top_k=1, context="chunk"))
            held[f"q{i}"] = len(engine.active.layout.prefix_ids) + len(prompt.chunk_ids[0])
            runs += [run(f"q{i}", prompt.prompt_ids), run(f"q{i}-full", prompt.prompt_ids, SKIP)]
            params = layout_params(prompt, ServeSettings())
    spec = {"kv_role": "kv_both", "max_model_len": 1024}
    result = probe(str(folder), full, runs, tmp_path, **spec)
    assert result["hybrid_allocator"]
    by_name = {r["name"]: r for r in result["runs"]}
    for name, num_held in held.items():
        matched, plain = by_name[name], by_name[f"{name}-full"]
        assert matched["num_cached_tokens"] == num_held  # to the chunk's entry's end, its state after it
        assert matched["first_token"] == plain["first_token"]
        # Every top-5 log-probability within 5e-6: measured within 1e-6 with the state loaded, and
        # 1.5e-5 to 2.6e-3 off when the load leaves it out (these test models' states fade slowly).
        assert matched["logprobs"].keys() == plain["logprobs"].keys()
        assert max(abs(matched["logprobs"][t] - p) for t, p in plain["logprobs"].items()) < 5e-6
    miss = probe(str(folder), lazy, [run("miss", runs[-1]["ids"], params, flush=True)], tmp_path, **spec)
    assert miss["write_back"] is None  # nothing saved
    with open_snapshot(lazy) as snapshot:
        assert snapshot.catalog.reports.counts()["kv_entries"] == 1  # the prefix only, as ingested
