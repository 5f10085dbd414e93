"""What every framework adapter (LangChain, LlamaIndex) shares: the engine's one scheduler
for every call (ragkv.engine: calls from many threads decode together), a chunk's identity
out (in a retriever's results) and back in (to answer from its stored KV), and an answer
streamed out of the running batch."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pydantic import BaseModel, model_validator

from ragkv.core.config import (
    DEFAULT_NO_REPEAT_NGRAM,
    DEFAULT_REPETITION_PENALTY,
    DEFAULT_RERANK,
    DEFAULT_RETRIEVAL,
    KV_RERANKER,
    AskSettings,
)
from ragkv.core.errors import InputError
from ragkv.core.filters import AnyOf, Filter, parse_filter
from ragkv.engine.answer import SECTION_SEPARATOR, Answer, AnswerStream, cite

IDENTITY = "ragkv"  # the metadata key under which results carry a chunk's identity


class AnswerOptions(BaseModel):
    """The answer options every adapter exposes (as `ragkv ask`'s), and the settings they make.
    Checked where every front's are, in AskSettings: a bad one fails the adapter's construction
    with the InputError `ragkv ask` gives."""

    top_k: int = 1
    context: str = "span"
    mode: str = "exact"
    rerank: int = DEFAULT_RERANK  # retrieving: candidates the model scores (as `ragkv ask --rerank`)
    reranker: str = KV_RERANKER  # what scores them: kv, a cross-encoder, or kv+MODEL (as `ragkv ask --reranker`)
    retrieval: str = DEFAULT_RETRIEVAL  # retrieving: dense, lexical or hybrid (as `ragkv ask --retrieval`)
    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] | None = None
    repetition_penalty: float = DEFAULT_REPETITION_PENALTY
    no_repeat_ngram: int = DEFAULT_NO_REPEAT_NGRAM

    @model_validator(mode="after")
    def _checked(self):
        self.ask_settings()
        return self

    def ask_settings(
        self,
        chunks=None,
        passages: Sequence[str] = (),
        stop: Sequence[str] | None = None,
        max_tokens: int | None = None,
    ) -> AskSettings:
        """These options as AskSettings, answering from `chunks` and `passages` when given (see
        `chunks_and_passages`), else retrieving; `stop` and `max_tokens` override per call."""
        options = {name: getattr(self, name) for name in AnswerOptions.model_fields if name != "max_tokens"}
        return AskSettings.from_dict(
            {
                **options,
                "stop": tuple(stop or self.stop or ()),
                "max_new_tokens": self.max_tokens if max_tokens is None else max_tokens,
                "chunks": chunks,
                "passages": tuple(passages),
            }
        )


def retrieve(
    engine,
    question: str,
    top_k: int,
    context: str,
    doc_ids: Sequence[str] | None = None,
    rerank: int = 0,
    retrieval: str = DEFAULT_RETRIEVAL,
    filters: Sequence[str] = (),
    reranker: str = KV_RERANKER,
) -> list[tuple[Any, float, dict]]:
    """(row, score, identity) of the chunks `engine.search` finds for `question` (reranked by
    `reranker` with `rerank` > 1; only from documents `filters` admit), widened to `context`."""
    hits = engine.retrieve(
        question, top_k, doc_ids, context, rerank, retrieval=retrieval, filters=filters, reranker=reranker
    )
    where = {"store": engine.snapshot.location, "generation": engine.snapshot.generation}
    return [
        (
            row,
            score,
            {
                **where,
                "doc_id": row.doc_id,
                "chunk_index": row.chunk_index,
                "chunk_id": row.chunk_id,
                "kv_key": row.entry.kv_key if row.entry else None,
            },
        )
        for row, score in hits
    ]


def chunks_and_passages(
    documents: Iterable[tuple[Any, str, float | None]], engine
) -> tuple[tuple[tuple[int, float], ...], tuple[str, ...]]:
    """From (identity or None, text, score) per document: (chunk id, score) of those from
    `engine`'s store and generation, and the text of the others (another retriever's, another
    store's, an older generation's), which are prefilled live."""
    chunks, passages = [], []
    for identity, text, score in documents:
        if (
            isinstance(identity, dict)
            and identity.get("store") == engine.snapshot.location
            and identity.get("generation") == engine.snapshot.generation
            and "chunk_id" in identity
        ):
            chunks.append((int(identity["chunk_id"]), float(score or 0.0)))
        else:
            passages.append(text)
    return tuple(chunks), tuple(passages)


def stream(engine, question: str, settings: AskSettings, history: Sequence[tuple[str, str]] = ()) -> AnswerStream:
    """The answer to `question` (after the earlier (user, assistant) turns `history`), decoded in
    the engine's batch: iterate it for text as it comes; `.answer` once done. Closing it early
    frees the row. Errors are ragkv's, with their one-line message."""

    return engine.stream(question, settings, history)


def source_texts(engine, answer: Answer, passages: Sequence[str]) -> list[tuple[Any, str]]:
    """(Source, its text) for each of the answer's sources: stored chunks' text from the catalog
    (read between two steps, which own the catalog), passages' from `passages`."""
    stored = [s.chunk_id for s in answer.sources if s.chunk_id >= 0]
    texts = engine.chunk_texts(stored) if stored else {}
    # A passage's Source has chunk id -1 - its index (see ragkv.retrieval.retriever.live_rows).
    return [(s, texts.get(s.chunk_id, "") if s.chunk_id >= 0 else passages[-1 - s.chunk_id]) for s in answer.sources]


def answer_metadata(engine, answer: Answer) -> dict:
    """What a reply carries under IDENTITY: sources, stats and token ids."""
    return answer.reply(model=engine.lm.facts.name)


def place(row) -> dict:
    """A retrieved chunk's source and, when its document has them, its pages, section path and
    citation ("manual.pdf p. 12-13, § Security › Rotating keys"), as a framework's metadata."""
    found: dict[str, Any] = {"source": row.source}
    if row.pages is not None:
        found["page"] = row.pages[0] if row.pages[0] == row.pages[1] else f"{row.pages[0]}-{row.pages[1]}"
    if row.section:
        found["section"] = SECTION_SEPARATOR.join(row.section)
    if row.pages is not None or row.section:
        found["citation"] = cite(row.doc_id, row.section, row.pages)
    return found


_OPERATORS = {"$eq": "=", "$ne": "!=", "$gt": ">", "$gte": ">=", "$lt": "<", "$lte": "<="}


def filters_from_mapping(where: Mapping[str, Any] | None) -> tuple[str, ...]:
    """A vector store's filter dict, as LangChain's retrievers take it (`{"year": 2025}`,
    `{"year": {"$gte": 2025}}`, `{"$and": [...]}`, `{"$or": [...]}` of comparisons), as ragkv
    filters (ragkv.core.filters). Anything else is an InputError naming it."""
    if not where:
        return ()
    found: list[str] = []
    for key, value in where.items():
        if key == "$and" and isinstance(value, list):
            for part in value:
                found += filters_from_mapping(part)
        elif key == "$or" and isinstance(value, list):
            found.append(any_of([filters_from_mapping(part) for part in value], "$or"))
        elif key.startswith("$"):
            raise InputError(f"filter operator {key!r} has no ragkv form; ragkv filters are AND-ed comparisons")
        elif isinstance(value, Mapping):
            for op, operand in value.items():
                if op not in _OPERATORS:
                    raise InputError(
                        f"filter operator {op!r} on {key!r} has no ragkv form; use one of {list(_OPERATORS)}"
                    )
                found.append(Filter(key, _OPERATORS[op], str(operand)).to_string())
        else:
            found.append(Filter(key, "=", str(value)).to_string())
    return tuple(found)


def any_of(alternatives: Sequence[Sequence[str]], named: str) -> str:
    """One ragkv filter holding when any of `alternatives` does (each one comparison: a filter
    joins comparisons with `or`, never a conjunction); InputError naming `named` otherwise."""
    if not alternatives or any(len(a) != 1 or isinstance(parse_filter(a[0]), AnyOf) for a in alternatives):
        raise InputError(f"{named} has a ragkv form only over single comparisons ('a=1 or b=2')")
    return " or ".join(a[0] for a in alternatives)
