"""LangChain on ragkv, with the real langchain-core (and langchain-openai against a real
`ragkv serve`): answers through the adapter equal `ask`'s token for token (float32), reuse the
stored KV by the documents' identity, stream, run async and from threads; a Document without
identity is prefilled live, exactly."""

from __future__ import annotations

import asyncio
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest

import ragkv
from tests.conftest import QUESTIONS, running_server

pytest.importorskip("langchain_core")
from langchain_core.documents import Document  # noqa: E402
from langchain_core.messages import AIMessage, HumanMessage  # noqa: E402
from langchain_core.runnables import RunnablePassthrough  # noqa: E402

from ragkv.integrations.langchain import ChatRagkv, RagkvRetriever, rag_prompt  # noqa: E402


@pytest.fixture(scope="module")
def rag(tiny_store):
    with ragkv.open(tiny_store, device="cpu") as engine:
        yield engine


def _ragkv(reply) -> dict:
    return reply.response_metadata["ragkv"]


def test_the_retriever_keeps_chunk_identity(rag):
    docs = RagkvRetriever(engine=rag, top_k=2).invoke(QUESTIONS[0])
    (row, score), _ = rag.retrieve(QUESTIONS[0], top_k=2, context="span")
    identity = docs[0].metadata["ragkv"]
    assert docs[0].page_content == row.text and docs[0].metadata["score"] == pytest.approx(score)
    assert identity["chunk_id"] == row.chunk_id and identity["kv_key"] == row.entry.kv_key
    assert identity["store"] == rag.snapshot.location and identity["generation"] == rag.snapshot.generation
    reranked = RagkvRetriever(engine=rag, top_k=2, context="chunk", rerank=5).invoke(QUESTIONS[0])
    found = rag.search(QUESTIONS[0], top_k=2, rerank=5)
    assert [d.metadata["ragkv"]["chunk_id"] for d in reranked] == [r.chunk_id for r in found]


def test_a_chain_answers_as_ask_does_from_the_stored_kv(rag):
    for question in QUESTIONS[:3]:
        alone = rag.ask(question, top_k=2, max_new_tokens=16)
        chain = (
            {"documents": RagkvRetriever(engine=rag, top_k=2), "question": RunnablePassthrough()}
            | rag_prompt
            | ChatRagkv(engine=rag, max_tokens=16)
        )
        reply = chain.invoke(question)
        assert _ragkv(reply)["token_ids"] == alone.token_ids and reply.content == alone.text
        # At least the stored chunks' tokens (the engine's prefix cache, warmed by `ask`, may add more).
        assert _ragkv(reply)["stats"]["reused_tokens"] >= alone.stats.reused_tokens > 0
        assert set(_ragkv(reply)["stats"]["kv_sources"].values()) <= {"store", "ram"}
        assert [s["chunk_id"] for s in _ragkv(reply)["sources"]] == [s.chunk_id for s in alone.sources]
        texts = [row.text for row, _ in rag.retrieve(question, top_k=2, context="span")]
        assert [d.page_content for d in reply.response_metadata["documents"]] == texts  # LangChain's own objects


def test_the_model_alone_retrieves_and_streams_the_same_text(rag):
    alone = rag.ask(QUESTIONS[1], max_new_tokens=20)
    llm = ChatRagkv(engine=rag, max_tokens=20)
    assert llm.invoke(QUESTIONS[1]).content == alone.text
    chunks = list(llm.stream(QUESTIONS[1]))
    assert len(chunks) > 2 and "".join(c.content for c in chunks) == alone.text


def test_async_calls_work_and_agree(rag):
    alone = rag.ask(QUESTIONS[2], max_new_tokens=12)
    llm = ChatRagkv(engine=rag, max_tokens=12)

    async def run():
        reply = await llm.ainvoke(QUESTIONS[2])
        streamed = "".join([c.content async for c in llm.astream(QUESTIONS[2])])
        both = await asyncio.gather(llm.ainvoke(QUESTIONS[2]), llm.ainvoke(QUESTIONS[0]))
        return reply.content, streamed, both[0].content

    assert asyncio.run(run()) == (alone.text,) * 3


def test_threads_share_one_engine(rag):
    expected = {q: rag.ask(q, max_new_tokens=10).token_ids for q in QUESTIONS}
    llm = ChatRagkv(engine=rag, max_tokens=10)
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(llm.invoke, QUESTIONS * 2))
    assert [_ragkv(r)["token_ids"] for r in replies] == [expected[q] for q in QUESTIONS * 2]
    assert max(_ragkv(r)["stats"]["batch_size"] for r in replies) >= 2  # they decoded together


def test_a_document_without_identity_is_prefilled_live_exactly(rag):
    ((row, _),) = rag.retrieve(QUESTIONS[0])
    foreign = [Document(page_content=row.text, metadata={"source": "another retriever"})]
    reply = ChatRagkv(engine=rag, max_tokens=16).invoke(QUESTIONS[0], documents=foreign)
    full = rag.ask(QUESTIONS[0], max_new_tokens=16, use_cache=False)  # the same prompt, fully prefilled
    stats = _ragkv(reply)["stats"]
    assert _ragkv(reply)["token_ids"] == full.token_ids and stats["reused_tokens"] == 0
    assert any("without ragkv identity" in w for w in stats["warnings"])
    assert [d.page_content for d in reply.response_metadata["documents"]] == [row.text]


def test_stop_max_tokens_and_history_map_to_ragkv(rag):
    llm = ChatRagkv(engine=rag, max_tokens=30)
    assert len(_ragkv(llm.invoke(QUESTIONS[0], max_tokens=3))["token_ids"]) == 3
    whole = llm.invoke(QUESTIONS[0]).content
    cut = whole[len(whole) // 2 : len(whole) // 2 + 3]
    if cut.strip():
        assert llm.invoke(QUESTIONS[0], stop=[cut]).content == whole[: whole.index(cut)]
    conversation = rag.conversation(max_new_tokens=8)
    first = conversation.ask(QUESTIONS[0])
    second = conversation.ask("And how often?")
    reply = llm.invoke(
        [HumanMessage(QUESTIONS[0]), AIMessage(first.text), HumanMessage("And how often?")], max_tokens=8
    )
    assert _ragkv(reply)["token_ids"] == second.token_ids


def test_bad_input_gets_one_line(rag):
    from ragkv.core.errors import InputError

    with pytest.raises(ValueError, match="human message") as raised:  # what LangChain code catches for bad input
        ChatRagkv(engine=rag).invoke([AIMessage("hello")])
    assert isinstance(raised.value, InputError) and len(str(raised.value).splitlines()) == 1
    with pytest.raises(InputError, match="not in store"):  # an identity the store does not hold (any more)
        ChatRagkv(engine=rag).invoke(
            QUESTIONS[0],
            documents=[
                Document(
                    page_content="x",
                    metadata={
                        "ragkv": {
                            "store": rag.snapshot.location,
                            "generation": rag.snapshot.generation,
                            "chunk_id": 10**9,
                        }
                    },
                )
            ],
        )


@pytest.mark.slow
def test_chat_openai_against_ragkv_serve_streams_and_passes_options(tmp_path, tiny_store):
    langchain_openai = pytest.importorskip("langchain_openai")
    store = tmp_path / "store"
    shutil.copytree(tiny_store, store)
    with ragkv.open(store, device="cpu") as engine:
        alone = engine.ask(QUESTIONS[0], top_k=2, max_new_tokens=12)
    with running_server(store) as (base, _):
        llm = langchain_openai.ChatOpenAI(
            base_url=f"{base}/v1",
            api_key="unused",
            model="ragkv",
            max_tokens=12,
            temperature=0,
            extra_body={"ragkv": {"top_k": 2}},
            max_retries=0,
        )
        assert llm.invoke(QUESTIONS[0]).content == alone.text
        assert "".join(c.content for c in llm.stream(QUESTIONS[0])) == alone.text


def test_a_store_for_another_model_is_a_one_line_value_error(tiny_store, tiny_qwen2):
    with pytest.raises(ValueError, match="has no KV for model") as raised:
        with ragkv.open(tiny_store, model=str(tiny_qwen2), device="cpu") as other:
            ChatRagkv(engine=other).invoke(QUESTIONS[0])
    assert len(str(raised.value).splitlines()) == 1
