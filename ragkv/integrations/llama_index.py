"""ragkv inside LlamaIndex apps (`pip install 'ragkv[llama-index]'`): a retriever whose nodes
carry ragkv's chunk identity, and a query engine that answers from the stored KV of the nodes
its retriever returns, by identity, not by text.

    rag = ragkv.open("./kvstore")
    engine = RagkvQueryEngine(engine=rag, top_k=3)                 # its retriever: RagkvNodeRetriever
    response = engine.query("How do I rotate the API key?")
    response.response, response.source_nodes, response.metadata["ragkv"]["stats"]
    RagkvQueryEngine(engine=rag, streaming=True).query(q).response_gen   # text as it is generated

A node without ragkv identity (another retriever's: pass `retriever=`) is prefilled live from
its text, exactly, and the stats say so. One engine serves every call and thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Generator, Sequence
from typing import Any

from ragkv.core.errors import MissingExtraError

try:
    from llama_index.core.base.response.schema import Response, StreamingResponse
    from llama_index.core.query_engine import CustomQueryEngine
    from llama_index.core.retrievers import BaseRetriever
    from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
    from llama_index.core.vector_stores.types import FilterCondition, MetadataFilters
    from pydantic import Field
except ModuleNotFoundError as exc:  # said once, naming the extra to install
    raise MissingExtraError("ragkv.integrations.llama_index", "llama-index", exc.name) from None

from ragkv.core.config import DEFAULT_RERANK, DEFAULT_RETRIEVAL
from ragkv.core.errors import InputError
from ragkv.core.filters import Filter
from ragkv.integrations import adapter
from ragkv.integrations.adapter import IDENTITY, AnswerOptions


class RagkvNodeRetriever(BaseRetriever):
    """Chunks nearest to the query as NodeWithScore: a TextNode with the chunk's text, its
    `source`, and under "ragkv" its identity (store, generation, doc_id, chunk_index,
    chunk_id, kv_key; kept out of the text LLMs and embedders see)."""

    def __init__(
        self,
        engine,
        top_k: int = 1,
        context: str = "span",
        doc_ids: Sequence[str] | None = None,
        rerank: int = DEFAULT_RERANK,
        retrieval: str = DEFAULT_RETRIEVAL,
        filters: MetadataFilters | Sequence[str] | None = None,
        reranker: str = "kv",
        **kwargs: Any,
    ):
        self.engine, self.top_k, self.context, self.doc_ids = engine, top_k, context, doc_ids
        self.rerank = rerank  # as `ragkv ask --rerank`: candidates the model scores over their stored KV
        self.retrieval = retrieval  # as `ragkv ask --retrieval`: dense, lexical or hybrid
        self.reranker = reranker  # as `ragkv ask --reranker`: kv, a cross-encoder, or kv+MODEL
        # Only documents matching: LlamaIndex's MetadataFilters (AND of comparisons), or ragkv filter strings.
        self.filters = filters_of(filters)
        super().__init__(**kwargs)

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        found = adapter.retrieve(
            self.engine,
            query_bundle.query_str,
            self.top_k,
            self.context,
            self.doc_ids,
            self.rerank,
            self.retrieval,
            self.filters,
            self.reranker,
        )
        return [
            NodeWithScore(
                score=score,
                node=TextNode(
                    id_=f"ragkv-{identity['generation']}-{row.chunk_id}",
                    text=row.text,
                    metadata={**adapter.place(row), IDENTITY: identity},
                    excluded_llm_metadata_keys=[IDENTITY],
                    excluded_embed_metadata_keys=[IDENTITY],
                ),
            )
            for row, score, identity in found
        ]


_OPERATORS = {"==": "=", "!=": "!=", ">": ">", ">=": ">=", "<": "<", "<=": "<="}


def filters_of(filters: MetadataFilters | Sequence[str] | None) -> tuple[str, ...]:
    """LlamaIndex's MetadataFilters (comparisons joined by AND, nested too, or by OR) as ragkv
    filters (ragkv.core.filters); NOT and list operators have no ragkv form: InputError naming them."""
    if filters is None:
        return ()
    if not isinstance(filters, MetadataFilters):
        return (filters,) if isinstance(filters, str) else tuple(filters)
    if filters.condition == FilterCondition.OR:
        either = [filters_of(MetadataFilters(filters=[part])) for part in filters.filters]
        return (adapter.any_of(either, "MetadataFilters condition 'or'"),)
    if filters.condition not in (None, FilterCondition.AND):
        raise InputError(f"MetadataFilters condition {filters.condition.value!r} has no ragkv form")
    found: list[str] = []
    for condition in filters.filters:
        if isinstance(condition, MetadataFilters):
            found += filters_of(condition)
            continue
        op = _OPERATORS.get(condition.operator.value)
        if op is None:
            raise InputError(
                f"filter operator {condition.operator.value!r} on {condition.key!r} has no ragkv form; "
                f"use one of {list(_OPERATORS)}"
            )
        found.append(Filter(condition.key, op, str(condition.value)).to_string())
    return tuple(found)


class RagkvQueryEngine(AnswerOptions, CustomQueryEngine):
    """Retrieve (with `retriever`, else a RagkvNodeRetriever of `top_k`), then answer from the
    nodes' stored KV. The response's `source_nodes` are the nodes; `metadata["ragkv"]` holds
    the sources, stats (reused tokens, TTFT) and token ids (with `streaming`, once the
    generator is done)."""

    engine: Any = Field(description="a ragkv engine: ragkv.open(STORE)")
    retriever: Any = None
    streaming: bool = False

    def custom_query(self, query_str: str) -> Response | StreamingResponse:
        retriever = self.retriever or RagkvNodeRetriever(self.engine, self.top_k, self.context)
        nodes = retriever.retrieve(query_str)
        chunks, passages = adapter.chunks_and_passages(
            [(n.node.metadata.get(IDENTITY), n.node.get_content(), n.score) for n in nodes], self.engine
        )
        answer = adapter.stream(self.engine, query_str, self.ask_settings(chunks, passages))
        metadata: dict = {}
        if self.streaming:
            return StreamingResponse(
                response_gen=self._filling(answer, metadata), source_nodes=nodes, metadata=metadata
            )
        text = "".join(answer)
        metadata[IDENTITY] = adapter.answer_metadata(self.engine, answer.result())
        return Response(response=text, source_nodes=nodes, metadata=metadata)

    def _filling(self, answer, metadata: dict) -> Generator[str, None, None]:
        yield from answer
        metadata[IDENTITY] = adapter.answer_metadata(self.engine, answer.result())

    async def acustom_query(self, query_str: str) -> Response | StreamingResponse:
        # The model runs on the batch's thread; waiting for it must not block the event loop.
        return await asyncio.to_thread(self.custom_query, query_str)
