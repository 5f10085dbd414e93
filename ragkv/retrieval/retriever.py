"""Retrieval on the online path: question -> vector search -> catalog rows -> widened to spans
or documents -> cut to fit the model's context -> the prompt's ids. One implementation serves
`ask`, conversations, the batcher and the fronts that send ids to another engine."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from ragkv.core.config import AskSettings, SearchSettings
from ragkv.core.errors import InputError, StoreEmptyError
from ragkv.core.filters import Condition, check_fields
from ragkv.core.text import check_text
from ragkv.kv import spans
from ragkv.loading.loader import continues_span
from ragkv.model.embed import Embedder
from ragkv.model.prompt import PromptLayout, encode_text
from ragkv.retrieval.search import Searched, first_stage
from ragkv.store import ContextRow, Hit, StoreSnapshot

MIN_ANSWER_TOKENS = 16  # a prompt must leave at least this much of the context to answer in
ROW_CACHE_ENTRIES = 100_000  # catalog rows kept per engine (small: text and token ids)
FILTER_CACHE_ENTRIES = 64  # filters whose admitted chunk ids are kept per generation

Retrieved = list[tuple[ContextRow, float]]  # a prompt's chunks, in prompt order, with their hit's score
# (question, candidates, top_k) -> the best top_k of them, and warnings (ragkv.retrieval.rerank.KVReranker.best)
Rerank = Callable[[str, Retrieved, int], tuple[Retrieved, list[str]]]


@dataclass
class Prompt:
    """A question's retrieved chunks and prompt ids: what `Retriever.prompt_for` returns."""

    retrieved: Retrieved
    prompt_ids: list[int]  # the whole prompt
    question_ids: list[int]  # its tail: the question with its template
    chunk_ids: list[tuple[int, ...]]  # each retrieved chunk's token ids
    retrieval_ms: float = 0.0  # question embedding + vector search
    embed_ms: float = 0.0  # of retrieval_ms: the question's embedding
    catalog_ms: float = 0.0  # catalog rows of the hits
    rerank_ms: float = 0.0  # scoring the candidates with the model (0: no rerank)
    num_reranked: int = 0  # candidates the rerank scored
    warnings: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class SearchResult:
    """One chunk `search` found: where it is, its text, and its scores."""

    doc_id: str
    source: str
    chunk_index: int
    chunk_id: int
    text: str
    score: float  # what the results are ordered by: the rerank's score when reranked, else the retrieval's
    retrieval_score: float  # the first stage's (dense: cosine similarity; lexical: BM25; hybrid: fused)
    likelihood: float | None = None  # reranked: mean log P(question token | chunk), in nats
    section: tuple[str, ...] = ()  # where it is: the deepest section holding it
    pages: tuple[int, int] | None = None  # ... and the pages (or slides) it covers
    citation: str = ""  # both in words (ragkv.engine.answer.cite)

    def to_dict(self) -> dict:
        """As JSON has it (the section and pages as lists)."""
        found = asdict(self)
        found["section"] = list(self.section)
        found["pages"] = list(self.pages) if self.pages is not None else None
        return found


class Retriever:
    """Searches one open generation (`switch` moves it to another) for one profile's prompts."""

    def __init__(
        self,
        snapshot: StoreSnapshot,
        embedder: Embedder,
        tokenizer,
        layout: PromptLayout,
        profile_id: str,
        max_context: int,
    ):
        self.snapshot = snapshot
        self.embedder = embedder
        self.tokenizer = tokenizer
        self.layout = layout
        self.profile_id = profile_id
        self.max_context = max_context
        self._row_cache: dict[int, ContextRow] = {}  # catalog rows of the open generation
        self._span_cache: dict[tuple[str, int], list[int]] = {}  # (doc, span start) -> its chunk ids
        self._filter_cache: dict[tuple[str, ...], Admitted] = {}  # filters -> the chunk ids they admit
        self._checked: set[tuple[str, ...]] = set()  # filters whose fields were checked
        self._fields: list[str] | None = None  # the documents' metadata fields

    def switch(self, snapshot: StoreSnapshot) -> None:
        """Search `snapshot` from now on (its rows replace the ones kept)."""
        self.snapshot = snapshot
        self._row_cache.clear()
        self._span_cache.clear()
        self._filter_cache.clear()
        self._checked.clear()
        self._fields = None

    def retrieve(
        self, question: str, top_k: int = 1, doc_ids: Sequence[str] | None = None, context: str = "chunk"
    ) -> Retrieved:
        """The `top_k` chunks nearest to `question` (dense), best first, with their cosine
        scores; only chunks of the documents `doc_ids` when given. With `context` "span" or
        "document", the prompt's chunks around them instead (see `widen`)."""
        search = SearchSettings(top_k, "dense", 0, tuple(doc_ids) if doc_ids is not None else None)
        return self.widen(self.rows(self.search(question, search).hits), context)

    def prompt_for(self, question: str, settings: AskSettings, rerank: Rerank | None = None) -> Prompt:
        """Retrieve (or take `settings.chunks`), rerank the first `settings.rerank` candidates
        with `rerank` when given, widen to `settings.context`, add the passages given as text,
        cut to fit the context, and lay out the prompt's ids. Needs no model weights (only the
        tokenizer) unless it reranks."""
        start = time.perf_counter()
        warnings: list[str] = []
        given = settings.chunks is not None  # the caller retrieved (a framework's retriever): no search
        reranks = rerank is not None and settings.rerank > 1 and not given
        if given:
            check_text(question)
        search = settings.search if reranks else dataclasses.replace(settings.search, rerank=0)
        embed_ms = 0.0
        if given:
            hits = self._given(settings)
        else:
            searched = self.search(question, search)
            hits, embed_ms = searched.hits, searched.latency_ms.get("embed_ms", 0.0)
            warnings += searched.warnings
        retrieval_ms = _ms(start)
        catalog_start = time.perf_counter()
        retrieved = self.rows(hits)
        catalog_ms = _ms(catalog_start)
        if given and len(retrieved) < len(hits):
            raise self._not_in_store(len(hits) - len(retrieved))
        if not retrieved and not settings.passages:
            raise StoreEmptyError(f"store {self.snapshot.location} returned no chunks for the question")
        if not given and len(retrieved) < settings.top_k:
            warnings.append(f"top_k {settings.top_k} but the store holds {len(retrieved)} chunks")
        rerank_ms, num_reranked = 0.0, 0
        if reranks and rerank is not None and len(retrieved) > 1:
            rerank_start, num_reranked = time.perf_counter(), len(retrieved)
            retrieved, said = rerank(question, retrieved, settings.top_k)
            rerank_ms = _ms(rerank_start)
            warnings += said
        if settings.passages:
            warnings.append(f"{len(settings.passages)} passages without ragkv identity were prefilled live")
        retrieved = self.widen(retrieved, settings.context) + live_rows(settings.passages)
        question_ids = self.layout.question_ids(self.tokenizer, question)
        retrieved, cut = self.fit_chunks(retrieved, question_ids)
        if cut:
            warnings.append(cut)
        if settings.order == "reuse":
            retrieved = reuse_first(retrieved)
        chunk_ids = [self.chunk_token_ids(row) for row, _ in retrieved]
        return Prompt(
            retrieved,
            self.layout.prompt_ids(chunk_ids, question_ids),
            question_ids,
            chunk_ids,
            retrieval_ms=retrieval_ms,
            embed_ms=embed_ms,
            catalog_ms=catalog_ms,
            rerank_ms=rerank_ms,
            num_reranked=num_reranked,
            warnings=warnings,
        )

    def _given(self, settings: AskSettings) -> list[Hit]:
        """The chunks the caller gave (`settings.chunks`), as hits; InputError if any is outside
        the scope, as if it were not in the store."""
        given = settings.chunks or ()
        visible = self.visible(settings.search, [chunk_id for chunk_id, _ in given])
        hits = [Hit(*chunk) for chunk in given if chunk[0] in visible]
        if len(hits) < len(given):
            raise self._not_in_store(len(given) - len(hits))
        return hits

    def _not_in_store(self, num_missing: int) -> InputError:
        return InputError(
            f"{num_missing} of the given chunks are not in store "
            f"{self.snapshot.location} (generation {self.snapshot.generation}): retrieve again"
        )

    def widen(self, hits: Retrieved, context: str) -> Retrieved:
        """The chunks a prompt holds for `hits`. "chunk": the hits themselves. "span": each hit
        with the chunks of its span before it (a span: a document's chunks whose KV was
        computed as one sequence, `ingest --span-tokens`); "document": each hit's whole span.
        Hits in one span merge into one run of its chunks, in document order, placed at its
        best hit's rank and carrying its score. A chunk stored on its own is its own span."""
        if context == "chunk":
            return hits
        runs: dict[tuple[str, int], tuple[int, float, list[int]]] = {}  # (doc, start) -> (last index, score, ids)
        for row, score in hits:
            if row.span_start is None:
                runs.setdefault((row.doc_id, row.chunk_index), (row.chunk_index, score, [row.chunk_id]))
                continue
            key = (row.doc_id, row.span_start)
            last, best, _ = runs.get(key, (row.chunk_index, score, []))
            runs[key] = (max(last, row.chunk_index), max(best, score), self._span_ids(row))
        widened: Retrieved = []
        for last, score, chunk_ids in runs.values():
            rows = [r for r, _ in self.rows([Hit(i, score) for i in chunk_ids])]
            if context == "span":
                rows = [r for r in rows if r.chunk_index <= last]
            widened += [(r, score) for r in rows]
        return widened

    def fit_chunks(self, retrieved: Retrieved, question_ids: list[int]) -> tuple[Retrieved, str]:
        """Drop the last chunks (the lowest-ranked hits, or a span's last chunks: cut at chunk
        boundaries) until the prompt leaves room to answer; returns them and a warning ("" if
        none was dropped)."""
        room = self.max_context - MIN_ANSWER_TOKENS
        before = len(retrieved)
        while (
            len(retrieved) > 1
            and len(self.layout.prompt_ids([self.chunk_token_ids(r) for r, _ in retrieved], question_ids)) > room
        ):
            retrieved = retrieved[:-1]
        if len(retrieved) == before:
            return retrieved, ""
        return retrieved, f"context cut from {before} to {len(retrieved)} chunks: more do not fit the model's context"

    def chunk_token_ids(self, row: ContextRow) -> tuple[int, ...]:
        """The token ids of a chunk in the prompt (stored with its KV, else its text's)."""
        if row.token_ids is not None:
            return row.token_ids
        # No KV for this profile (not computed yet): the text's ids, prefilled live.
        return tuple(encode_text(self.tokenizer, row.text))

    def search(self, question: str, settings: SearchSettings) -> Searched:
        """The first stage's `settings.depth` candidates for `question` (see ragkv.retrieval.search),
        only from the documents `settings.doc_ids` and `settings.filters` admit."""
        check_text(question)
        allowed = self.allowed(settings)
        return first_stage(self.snapshot.vectors, self.embedder, question, settings.depth, settings.retrieval, allowed)

    def allowed(self, settings: SearchSettings) -> list[int] | None:
        """The chunk ids a search may return (None: any): those of the documents `doc_ids`
        names and `filters` admit, within the scope. A document outside the scope is refused
        as one the store lacks, by the same message after the same catalog lookup."""
        scope = settings.scope.conditions if settings.scope is not None and settings.scope.filters else None
        visible = self._matching(scope, checked=False) if scope is not None else None
        allowed: list[int] | None = None
        if settings.doc_ids is not None:
            allowed = []
            for doc_id in settings.doc_ids:
                chunk_ids = self.snapshot.catalog.documents.chunk_ids_of(doc_id)
                if visible is not None:
                    chunk_ids = [c for c in chunk_ids if c in visible]
                if not chunk_ids:
                    raise InputError(f"no document {doc_id!r} in the store")
                allowed += chunk_ids
        elif scope is not None:
            allowed = self._admitted(scope, checked=False).ids
        if settings.filters:
            admitted = self._admitted(settings.conditions, checked=True)
            allowed = admitted.ids if allowed is None else [c for c in allowed if c in admitted.set]
        return allowed

    def visible(self, settings: SearchSettings, chunk_ids: Sequence[int]) -> list[int]:
        """Of `chunk_ids`, those the settings' scope admits (all, without a scope)."""
        if settings.scope is None or not settings.scope.filters:
            return list(chunk_ids)
        visible = self._matching(settings.scope.conditions, checked=False)
        return [c for c in chunk_ids if c in visible]

    def _matching(self, conditions: Sequence[Condition], checked: bool) -> frozenset[int]:
        return self._admitted(conditions, checked).set

    def _admitted(self, conditions: Sequence[Condition], checked: bool) -> Admitted:
        """The chunk ids of the documents every condition admits. Kept per generation, by
        filter (rows never change in one). `checked`: a field no document has is an error (a
        client's filter) rather than matching nothing (a scope's, set by the server)."""
        key = tuple(c.to_string() for c in conditions)
        if key not in self._filter_cache:
            if checked:
                check_fields(conditions, self._metadata_fields())
            if len(self._filter_cache) >= FILTER_CACHE_ENTRIES:
                self._filter_cache.pop(next(iter(self._filter_cache)))
            self._filter_cache[key] = Admitted(self.snapshot.catalog.documents.chunk_ids_matching(conditions))
        elif checked and key not in self._checked:
            check_fields(conditions, self._metadata_fields())
        if checked:
            self._checked.add(key)
        return self._filter_cache[key]

    def _metadata_fields(self) -> list[str]:
        if self._fields is None:
            self._fields = self.snapshot.catalog.documents.metadata_fields()
        return self._fields

    def rows(self, hits: list[Hit]) -> Retrieved:
        """Catalog rows of the hits; rows are immutable within a generation, so they are kept."""
        missing = [h.chunk_id for h in hits if h.chunk_id not in self._row_cache]
        if missing:
            if len(self._row_cache) > ROW_CACHE_ENTRIES:
                self._row_cache.clear()
            for row in self.snapshot.catalog.entries.context_rows(self.profile_id, missing):
                self._row_cache[row.chunk_id] = row
        return [(self._row_cache[h.chunk_id], h.score) for h in hits if h.chunk_id in self._row_cache]

    def _span_ids(self, row: ContextRow) -> list[int]:
        assert row.span_start is not None  # asked only of a row inside a span
        key = (row.doc_id, row.span_start)
        if key not in self._span_cache:
            self._span_cache[key] = self.snapshot.catalog.entries.span_chunk_ids(
                self.profile_id, row.doc_id, row.span_start
            )
        return self._span_cache[key]


class Admitted:
    """The chunk ids a filter admits: in order (for the search) and as a set (to test)."""

    def __init__(self, ids: list[int]):
        self.ids = ids
        self.set = frozenset(ids)


def live_rows(passages: Sequence[str]) -> Retrieved:
    """Passages given as text (no ragkv identity: another retriever's) as prompt chunks that are
    always prefilled, never looked up or stored. Their chunk ids are -1, -2, ... for passage 0,
    1, ... (stored chunks' ids are never negative), so a Source names the passage it was."""
    return [
        (ContextRow(-1 - i, f"passage-{i}", f"(passage {i}, given as text)", 0, text, None, None, live=True), 0.0)
        for i, text in enumerate(passages)
    ]


def _ms(since: float) -> float:
    return (time.perf_counter() - since) * 1000.0


def reuse_first(retrieved: Retrieved) -> Retrieved:
    """`retrieved` with the run of chunks (one chunk, or chunks of one stored span that follow each
    other) whose stored KV is the most tokens moved to the front (`--order reuse`): the exact mode
    loads the first run from the store and computes the rest on top (a recurrent model's state
    continues only the first), so this order reuses the most. The other runs keep their order;
    of runs that reuse as much, the first retrieved leads."""
    rows = [row for row, _ in retrieved]
    runs = spans.runs(list(range(len(rows))), lambda i, j: continues_span(rows[i], rows[j]))

    def stored_tokens(run: list[int]) -> int:
        if rows[run[0]].live or not rows[run[0]].starts_span:
            return 0
        total = 0
        for index in run:  # a miss stops what loads from the store
            if rows[index].entry is None or rows[index].token_ids is None:
                break
            total += len(rows[index].token_ids or ())
        return total

    best = max(range(len(runs)), key=lambda k: (stored_tokens(runs[k]), -k))
    order = runs[best] + [index for k, run in enumerate(runs) if k != best for index in run]
    return [retrieved[index] for index in order]
