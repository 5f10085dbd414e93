"""LlamaIndex on ragkv, with the real llama-index-core (and its OpenAI-like LLM against a real
`ragkv serve`): a query engine's answer equals `ask`'s token for token (float32), from the
stored KV found by the nodes' identity; streaming and async work; a node without identity is
prefilled live, exactly."""

from __future__ import annotations

import asyncio
import shutil

import pytest

import ragkv
from tests.conftest import QUESTIONS, running_server

pytest.importorskip("llama_index.core")
from llama_index.core.retrievers import BaseRetriever  # noqa: E402
from llama_index.core.schema import NodeWithScore, TextNode  # noqa: E402

from ragkv.integrations.llama_index import RagkvNodeRetriever, RagkvQueryEngine  # noqa: E402


@pytest.fixture(scope="module")
def rag(tiny_store):
    with ragkv.open(tiny_store, device="cpu") as engine:
        yield engine


def test_nodes_carry_chunk_identity_out_of_the_llm_text(rag):
    nodes = RagkvNodeRetriever(rag, top_k=2).retrieve(QUESTIONS[0])
    (row, score), _ = rag.retrieve(QUESTIONS[0], top_k=2, context="span")
    identity = nodes[0].node.metadata["ragkv"]
    assert nodes[0].node.get_content() == row.text and nodes[0].score == pytest.approx(score)
    assert identity["chunk_id"] == row.chunk_id and identity["kv_key"] == row.entry.kv_key
    assert "kv_key" not in nodes[0].node.get_content(metadata_mode="llm")
    reranked = RagkvNodeRetriever(rag, top_k=2, context="chunk", rerank=5).retrieve(QUESTIONS[0])
    found = rag.search(QUESTIONS[0], top_k=2, rerank=5)
    assert [n.node.metadata["ragkv"]["chunk_id"] for n in reranked] == [r.chunk_id for r in found]


def test_the_query_engine_answers_as_ask_does(rag):
    for question in QUESTIONS[:3]:
        alone = rag.ask(question, top_k=2, max_new_tokens=16)
        response = RagkvQueryEngine(engine=rag, top_k=2, max_tokens=16).query(question)
        meta = response.metadata["ragkv"]
        assert meta["token_ids"] == alone.token_ids and response.response == alone.text
        assert meta["stats"]["reused_tokens"] >= alone.stats.reused_tokens > 0
        assert [n.node.metadata["ragkv"]["chunk_id"] for n in response.source_nodes] == [
            s.chunk_id for s in alone.sources
        ]


def test_streaming_and_async(rag):
    alone = rag.ask(QUESTIONS[1], max_new_tokens=14)
    streamed = RagkvQueryEngine(engine=rag, max_tokens=14, streaming=True).query(QUESTIONS[1])
    assert "".join(streamed.response_gen) == alone.text and streamed.metadata["ragkv"]["token_ids"] == alone.token_ids
    engine = RagkvQueryEngine(engine=rag, max_tokens=14)

    async def run():
        return await asyncio.gather(engine.aquery(QUESTIONS[1]), engine.aquery(QUESTIONS[2]))

    first, _ = asyncio.run(run())
    assert first.response == alone.text


class _Given(BaseRetriever):
    """Another retriever: returns the nodes it was given."""

    def __init__(self, nodes):
        self.nodes = nodes
        super().__init__()

    def _retrieve(self, query_bundle):
        return self.nodes


def test_a_node_without_identity_is_prefilled_live_exactly(rag):
    ((row, _),) = rag.retrieve(QUESTIONS[0])
    foreign = _Given([NodeWithScore(node=TextNode(text=row.text), score=0.5)])
    response = RagkvQueryEngine(engine=rag, retriever=foreign, max_tokens=16).query(QUESTIONS[0])
    full = rag.ask(QUESTIONS[0], max_new_tokens=16, use_cache=False)
    stats = response.metadata["ragkv"]["stats"]
    assert response.metadata["ragkv"]["token_ids"] == full.token_ids and stats["reused_tokens"] == 0
    assert any("without ragkv identity" in w for w in stats["warnings"])


@pytest.mark.slow
def test_openai_like_against_ragkv_serve_streams_and_passes_options(tmp_path, tiny_store):
    openai_like = pytest.importorskip("llama_index.llms.openai_like")
    from llama_index.core.llms import ChatMessage

    store = tmp_path / "store"
    shutil.copytree(tiny_store, store)
    with ragkv.open(store, device="cpu") as engine:
        alone = engine.ask(QUESTIONS[0], top_k=2, max_new_tokens=12)
    with running_server(store) as (base, _):
        llm = openai_like.OpenAILike(
            api_base=f"{base}/v1",
            api_key="unused",
            model="ragkv",
            is_chat_model=True,
            max_tokens=12,
            temperature=0,
            max_retries=0,
            additional_kwargs={"extra_body": {"ragkv": {"top_k": 2}}},
        )
        messages = [ChatMessage(role="user", content=QUESTIONS[0])]
        assert llm.chat(messages).message.content == alone.text
        assert "".join(part.delta or "" for part in llm.stream_chat(messages)) == alone.text
