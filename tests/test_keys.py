"""Cache keys: every input that changes the KV changes the key; keys are stable values."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from ragkv.core.errors import StoreFormatError
from ragkv.core.keys import KVKey, Profile
from ragkv.model.fingerprint import folder_fingerprint
from ragkv.model.llm import tokenizer_fingerprint
from ragkv.model.prompt import PromptLayout

BASE = Profile(
    model_fingerprint="m" * 64,
    tokenizer_fingerprint="t" * 64,
    template_fingerprint="p" * 64,
    prefix_ids=(1, 9690, 198, 2683),
    dtype="float32",
)
CHUNK = [504, 3458, 314, 18208, 30]


@pytest.mark.parametrize(
    "field, value",
    [
        ("model_fingerprint", "M" * 64),
        ("tokenizer_fingerprint", "T" * 64),
        ("template_fingerprint", "P" * 64),
        ("prefix_ids", (1, 9690, 198, 2684)),  # another system prompt, or the chunk at another position
        ("prefix_ids", (1, 9690, 198)),
        ("dtype", "bfloat16"),
        ("kv_quant", "int8"),
    ],
)
def test_every_profile_field_changes_every_key(field, value):
    changed = dataclasses.replace(BASE, **{field: value})
    assert changed.profile_id != BASE.profile_id
    assert KVKey.for_chunk(changed, CHUNK) != KVKey.for_chunk(BASE, CHUNK)
    assert KVKey.for_prefix(changed) != KVKey.for_prefix(BASE)


def test_chunk_tokens_change_the_key_and_prefix_differs_from_chunks():
    assert KVKey.for_chunk(BASE, CHUNK) != KVKey.for_chunk(BASE, CHUNK[:-1])
    assert KVKey.for_chunk(BASE, CHUNK) != KVKey.for_chunk(BASE, CHUNK[::-1])
    assert KVKey.for_chunk(BASE, CHUNK) != KVKey.for_chunk(BASE, [c + 65536 for c in CHUNK])
    assert KVKey.for_chunk(BASE, []) != KVKey.for_prefix(BASE)


def test_key_string_round_trips_and_rejects_garbage():
    key = KVKey.for_chunk(BASE, CHUNK)
    assert KVKey.from_string(key.to_string()) == key
    for bad in ["", "kv1:abc", "kv2:a:b", "nonsense"]:
        with pytest.raises(StoreFormatError, match="not a ragkv KV key"):
            KVKey.from_string(bad)


def test_keys_are_stable_across_processes_and_releases():
    """Pinned value: a change here silently turns every existing store into misses."""
    key = KVKey.for_chunk(BASE, CHUNK).to_string()
    code = (
        "from tests.test_keys import BASE, CHUNK; from ragkv.core.keys import KVKey; "
        "print(KVKey.for_chunk(BASE, CHUNK).to_string())"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True, cwd=root)
    assert other.stdout.strip() == key
    assert key == (
        "kv1:a276c41c96c80003145e3c2e12eff11eb92e2dd816f14cb25a51fa4d6ce3cc1b:"
        "3d8ed3af72ccf11d9b3f6b8117892b2dd4908b2ebb05ed389cf47f613a1c4daf"
    )


def test_weights_and_config_change_the_model_fingerprint(tiny_llama, tmp_path):
    import shutil

    copy = tmp_path / "model"
    shutil.copytree(tiny_llama, copy)
    before = folder_fingerprint(copy)
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01  # one bit of one weight
    weights.write_bytes(bytes(data))
    after_weights = folder_fingerprint(copy)
    config = copy / "config.json"
    config.write_text(config.read_text().replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 1e-05'))
    after_config = folder_fingerprint(copy)
    assert len({before, after_weights, after_config}) == 3


def test_tokenizer_template_and_system_prompt_change_the_profile(tiny_llama):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    base = PromptLayout.build(tokenizer, "You are helpful.")
    other_prompt = PromptLayout.build(tokenizer, "You are terse.")
    assert other_prompt.prefix_ids != base.prefix_ids
    assert other_prompt.template_fingerprint != base.template_fingerprint

    tokenizer.chat_template = tokenizer.chat_template.replace("<|im_start|>", "<|im_start|> ")
    assert PromptLayout.build(tokenizer, "You are helpful.").template_fingerprint != base.template_fingerprint

    before = tokenizer_fingerprint(tokenizer)
    tokenizer.add_tokens(["<ragkv_new_token>"])
    assert tokenizer_fingerprint(tokenizer) != before
