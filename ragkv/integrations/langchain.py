"""ragkv inside LangChain apps (`pip install 'ragkv[langchain]'`): a retriever whose Documents
carry ragkv's chunk identity, and a chat model that answers from the stored KV of the chunks
it is given by identity, not by text, so `retriever -> prompt -> llm` chains reuse the KV.

    rag = ragkv.open("./kvstore")
    retriever = RagkvRetriever(engine=rag, top_k=3)
    llm = ChatRagkv(engine=rag, max_tokens=128)
    chain = {"documents": retriever, "question": RunnablePassthrough()} | rag_prompt | llm
    chain.invoke("How do I rotate the API key?").content          # or .stream(), .ainvoke(), ...
    llm.invoke("How do I rotate the API key?")                     # retrieves by itself

A framework's usual prompt renders documents into text, and text alone cannot find stored
KV; `rag_prompt` instead puts the question in the human message and the documents in its
`additional_kwargs["documents"]`, so the model sees their identity (other chat models read
the rendered text in `additional_kwargs["context"]`, see `rag_prompt`). A Document without
ragkv identity (another retriever's) is prefilled live from its text: exact, said in the
stats. One engine is shared by every call and thread: calls decode together in its scheduler.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from ragkv.core.errors import MissingExtraError

try:
    from langchain_core.callbacks import CallbackManagerForLLMRun, CallbackManagerForRetrieverRun
    from langchain_core.documents import Document
    from langchain_core.language_models import BaseChatModel
    from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, HumanMessage
    from langchain_core.messages.ai import UsageMetadata
    from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
    from langchain_core.prompt_values import ChatPromptValue
    from langchain_core.retrievers import BaseRetriever
    from langchain_core.runnables import RunnableLambda
    from pydantic import ConfigDict, Field
except ModuleNotFoundError as exc:  # said once, naming the extra to install
    raise MissingExtraError("ragkv.integrations.langchain", "langchain", exc.name) from None

from ragkv.core.config import DEFAULT_RERANK, DEFAULT_RETRIEVAL, AskSettings
from ragkv.core.errors import InputError
from ragkv.integrations import adapter
from ragkv.integrations.adapter import IDENTITY, AnswerOptions


class RagkvRetriever(BaseRetriever):
    """Chunks nearest to the query, as Documents: `page_content` the chunk's text, `metadata`
    its `source`, `score` and, under "ragkv", its identity (store, generation, doc_id,
    chunk_index, chunk_id, kv_key)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    engine: Any = Field(description="a ragkv engine: ragkv.open(STORE)")
    top_k: int = 1
    context: str = "span"  # as `ragkv ask --context`: a hit brings its span's chunks before it
    doc_ids: tuple[str, ...] | None = None
    rerank: int = DEFAULT_RERANK  # as `ragkv ask --rerank`: candidates the model scores over their stored KV
    retrieval: str = DEFAULT_RETRIEVAL  # as `ragkv ask --retrieval`: dense, lexical or hybrid
    reranker: str = "kv"  # as `ragkv ask --reranker`: kv, a cross-encoder, or kv+MODEL
    # Only documents matching: ragkv filter strings ("year>=2025"), or a vector store's filter
    # dict ({"year": {"$gte": 2025}}); `invoke(query, filter=...)` adds to them per call.
    filter: tuple[str, ...] | dict | None = None

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun, filter: Any = None
    ) -> list[Document]:
        filters = _filters(self.filter) + _filters(filter)
        return [
            Document(page_content=row.text, metadata={**adapter.place(row), "score": score, IDENTITY: identity})
            for row, score, identity in adapter.retrieve(
                self.engine,
                query,
                self.top_k,
                self.context,
                self.doc_ids,
                self.rerank,
                self.retrieval,
                filters,
                self.reranker,
            )
        ]


def _filters(given: Any) -> tuple[str, ...]:
    if given is None:
        return ()
    if isinstance(given, dict):
        return adapter.filters_from_mapping(given)
    return (given,) if isinstance(given, str) else tuple(given)


def _render(question: str, documents: Sequence[Document]) -> str:
    context = "\n\n".join(d.page_content for d in documents)
    return f"Context:\n{context}\n\nQuestion: {question}"


def _rag_prompt(inputs: dict) -> ChatPromptValue:
    documents = list(inputs.get("documents") or [])
    question = inputs["question"]
    return ChatPromptValue(
        messages=[
            HumanMessage(
                content=question, additional_kwargs={"documents": documents, "context": _render(question, documents)}
            )
        ]
    )


rag_prompt = RunnableLambda(_rag_prompt, name="ragkv_prompt")
rag_prompt.__doc__ = """{"question", "documents"} -> one human message: the question as its content, the
documents (identity kept) in additional_kwargs["documents"], and the usual rendered prompt in
additional_kwargs["context"] for models that read text."""


def _documents(documents: Sequence[Document]) -> list[tuple[Any, str, float]]:
    return [
        (d.metadata.get(IDENTITY), d.page_content, d.metadata.get("score", 0.0))
        if isinstance(d.metadata, dict)
        else (None, d.page_content, 0.0)
        for d in documents
    ]


class ChatRagkv(AnswerOptions, BaseChatModel):
    """A chat model that answers from ragkv's stored KV. The last human message is the question;
    its `additional_kwargs["documents"]` (or `documents=` given to invoke) are the context, else
    it retrieves `top_k` chunks itself. Earlier human/AI turns are replayed as a conversation.
    The reply's `response_metadata["ragkv"]` holds the sources and stats (reused tokens, TTFT)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    engine: Any = Field(description="a ragkv engine: ragkv.open(STORE)")

    @property
    def _llm_type(self) -> str:
        return "ragkv"

    @property
    def _identifying_params(self) -> dict:
        return {"store": self.engine.snapshot.location, "model": self.engine.lm.facts.name, "mode": self.mode}

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        chunks = list(self._stream(messages, stop, run_manager, **kwargs))
        message = AIMessage(
            content="".join(str(c.message.content) for c in chunks),
            response_metadata=chunks[-1].message.response_metadata,
            usage_metadata=chunks[-1].message.usage_metadata,  # type: ignore[attr-defined] # an AIMessageChunk's
        )
        return ChatResult(generations=[ChatGeneration(message=message)])

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        history, question, documents = _split(messages)
        settings = self._settings(stop, kwargs, kwargs.get("documents", documents))
        answer = adapter.stream(self.engine, question, settings, history)
        for delta in answer:
            if run_manager:
                run_manager.on_llm_new_token(delta)
            yield ChatGenerationChunk(message=AIMessageChunk(content=delta))
        done = answer.result()
        stats = done.stats
        usage: UsageMetadata = {
            "input_tokens": stats.prompt_tokens,
            "output_tokens": len(done.token_ids),
            "total_tokens": stats.prompt_tokens + len(done.token_ids),
        }
        sources = [
            Document(page_content=text, metadata={"source": s.source, "score": s.score})
            for s, text in adapter.source_texts(self.engine, done, settings.passages)
        ]
        yield ChatGenerationChunk(
            message=AIMessageChunk(
                content="",
                usage_metadata=usage,
                response_metadata={
                    "finish_reason": stats.finish_reason or "stop",
                    "model_name": self.engine.lm.facts.name,
                    "documents": sources,
                    IDENTITY: adapter.answer_metadata(self.engine, done),
                },
            )
        )

    def _settings(self, stop, kwargs: dict, documents) -> AskSettings:
        unknown = set(kwargs) - {"documents", "max_tokens"}
        if unknown:
            raise InputError(f"ChatRagkv takes no {', '.join(sorted(unknown))}")
        chunks, passages = (
            (None, ()) if documents is None else adapter.chunks_and_passages(_documents(documents), self.engine)
        )
        return self.ask_settings(chunks, passages, stop, kwargs.get("max_tokens"))


def _split(messages: list[BaseMessage]) -> tuple[list[tuple[str, str]], str, list[Document] | None]:
    """(earlier (human, AI) pairs, the last human message's text, its documents or None)."""
    turns = [m for m in messages if m.type in ("human", "ai")]
    if not turns or turns[-1].type != "human":
        raise InputError("the last message must be a human message: the question")
    history, pending = [], None
    for message in turns[:-1]:
        if message.type == "human":
            pending = _text(message)
        elif pending is not None:
            history.append((pending, _text(message)))
            pending = None
    last = turns[-1]
    return history, _text(last), last.additional_kwargs.get("documents")


def _text(message: BaseMessage) -> str:
    content = message.content
    if isinstance(content, str):
        return content
    return "".join(part if isinstance(part, str) else part.get("text", "") for part in content)
