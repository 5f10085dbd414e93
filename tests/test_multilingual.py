"""Chinese (and other CJK) documents: chunk boundaries fall at sentence ends or safe points,
never inside a number or a word; a model given by path with its own multilingual tokenizer
ingests them and answers exactly (cached == full prefill)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

import ragkv
from ragkv.core.config import IngestSettings, ModelSettings
from ragkv.model.prompt import encode_text
from ragkv.pipelines.reading.chunk import chunk_text
from tests.families import TINY

from .conftest import SAMPLE_DATA

ZH_DOCS = SAMPLE_DATA / "zh"
SENTENCE_ENDS = tuple("。！？；：")
NUMBERS = re.compile(r"\d+(?:\.\d+)+%?")


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from ragkv.model.llm import bundled_smollm2_path

    return AutoTokenizer.from_pretrained(bundled_smollm2_path())


@pytest.mark.parametrize("max_tokens", [48, 96, 160])
def test_chinese_chunks_end_at_sentence_ends_and_keep_numbers_whole(smollm2_tokenizer, max_tokens):
    text = (ZH_DOCS / "rotate-api-key.md").read_text()
    chunks = chunk_text(text, smollm2_tokenizer, max_tokens)
    assert len(chunks) > 1
    assert all(len(encode_text(smollm2_tokenizer, c)) <= max_tokens for c in chunks)
    # Nothing lost or invented: the chunks are the text, cut (white space aside).
    assert re.sub(r"\s+", "", "".join(chunks)) == re.sub(r"\s+", "", text)
    for number in NUMBERS.findall(text):  # 5.4.3, 0.1%: each whole inside one chunk
        assert any(number in c for c in chunks), number
    # A sentence that fits is never cut: every chunk ends at a sentence end or a heading,
    # except where a single sentence is longer than a chunk.
    sentences = re.split(r"(?<=[。！？；：])", text)
    for chunk in chunks[:-1]:
        if chunk.endswith(SENTENCE_ENDS) or chunk.split("\n")[-1].startswith("#"):
            continue
        tail = chunk[-6:]
        long_sentence = next(s for s in sentences if tail in s)
        assert len(encode_text(smollm2_tokenizer, long_sentence)) > max_tokens // 2, chunk


def test_a_run_on_chinese_sentence_is_cut_after_a_comma_not_mid_word(smollm2_tokenizer):
    sentence = (
        "，".join(
            [
                "第一步打开管理控制台并进入设置页面",
                "第二步在要替换的密钥旁边点击创建新密钥",
                "第三步把新密钥复制到保险库中",
                "第四步观察错误率面板十分钟",
            ]
            * 3
        )
        + "。"
    )
    chunks = chunk_text(sentence, smollm2_tokenizer, 40)
    assert len(chunks) > 2
    assert all(c.endswith(("，", "。")) for c in chunks), chunks


def test_english_list_numbers_stay_with_their_items(smollm2_tokenizer):
    text = (SAMPLE_DATA / "runbooks" / "rotate-api-key.md").read_text()
    for chunk in chunk_text(text, smollm2_tokenizer, 64):
        assert not re.search(r"\n\s*\d\.$", chunk), chunk  # "4." left at the end of the chunk before its item


def _multilingual_model(folder: Path) -> Path:
    """A tiny random Llama with its own byte-level BPE tokenizer trained on Chinese and
    English text, and a ChatML template: what a user's multilingual model looks like, by path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from ragkv.model.llm import bundled_smollm2_path

    corpus = [p.read_text() for p in ZH_DOCS.glob("*.md")] + ["How do I rotate the API key? 如何轮换密钥？"]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokenizer.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=600, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = (bundled_smollm2_path() / "chat_template.jinja").read_text()
    fast.save_pretrained(folder)
    torch.manual_seed(0)
    config = LlamaConfig(**{**TINY, "vocab_size": tokenizer.get_vocab_size()})
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def test_a_multilingual_model_by_path_ingests_and_answers_chinese_exactly(tmp_path):
    model = _multilingual_model(tmp_path / "my model (zh)")
    docs = tmp_path / "docs"
    shutil.copytree(ZH_DOCS, docs)
    store = tmp_path / "store"
    report = ragkv.ingest(
        [docs], store, model=ModelSettings(model=str(model), device="cpu"), settings=IngestSettings(chunk_tokens=128)
    )
    assert report.documents["added"] == 2 and report.kv_computed > 2
    question = "旧密钥什么时候吊销？"
    with ragkv.open(store, device="cpu") as engine:
        assert engine.lm.facts.path == str(model)
        assert len(engine.lm.tokenizer.encode("轮换密钥")) < len("轮换密钥".encode())  # its own merges, not raw bytes
        cached = engine.ask(question, max_new_tokens=12)
        full = engine.ask(question, max_new_tokens=12, use_cache=False)
        assert cached.stats.mode == "exact" and cached.stats.reused_tokens > 0
        assert cached.token_ids == full.token_ids
        assert cached.sources[0].doc_id in {"rotate-api-key.md", "leave-policy.md"}
