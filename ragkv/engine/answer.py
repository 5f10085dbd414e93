"""What `ask` returns: the answer text and ids, where the context came from, and how long it took."""

from __future__ import annotations

import copy
import time
from collections.abc import Generator, Iterator
from dataclasses import asdict, dataclass, field, fields, is_dataclass


@dataclass(frozen=True)
class Source:
    doc_id: str
    source: str  # file path (and jsonl line) the document was read from
    chunk_index: int
    chunk_id: int
    score: float  # the retrieval's score (cosine, BM25, fused; reranked: the rerank's)
    section: tuple[str, ...] = ()  # the deepest section holding the chunk (headings, outermost first)
    pages: tuple[int, int] | None = None  # the pages (or slides) the chunk covers
    citation: str = ""  # both in words: "manual.pdf p. 12-13, § Security › Rotating keys" (see `cite`)

    @classmethod
    def of(cls, row, score: float) -> Source:
        """The source of a retrieved chunk (a catalog ContextRow)."""
        section, pages = tuple(row.section), row.pages
        return cls(
            row.doc_id,
            row.source,
            row.chunk_index,
            row.chunk_id,
            score,
            section,
            pages,
            cite(row.doc_id, section, pages),
        )


SECTION_SEPARATOR = " › "  # between the headings of a section path, outermost first


def cite(doc_id: str, section: tuple[str, ...], pages: tuple[int, int] | None) -> str:
    """Where a chunk is, in words: the document, its pages (slides are pages too), its section."""
    parts = [doc_id]
    if pages is not None:
        parts.append(f"p. {pages[0]}" if pages[0] == pages[1] else f"p. {pages[0]}-{pages[1]}")
    where = " ".join(parts)
    return f"{where}, § {SECTION_SEPARATOR.join(section)}" if section else where


@dataclass
class Stats:
    # how stored KV was used: "exact", or an approximate mode (concat, blend,
    # epic, ape: see `is_approximate`); "full": --no-cache; "fallback": a store miss answered
    # with a full prefill
    mode: str
    reused_tokens: int = 0  # prompt tokens whose KV came from the store (or the prefix cache)
    computed_tokens: int = 0  # prompt tokens prefilled now
    recomputed_tokens: int = 0  # blend: context tokens whose stored KV was recomputed
    prefix_cache_tokens: int = 0  # of the reused, those found in the in-process prefix cache
    kv_quant: str = (
        "none"  # how the reused KV was stored: "none" (lossless) or bfloat16/float16/int8/int4/int2 (approximate)
    )
    ram_hits: int = 0  # chunk KV found in the engine's RAM tier
    ram_misses: int = 0  # chunk KV read (and verified) from the store
    generated_tokens: int = 0
    retrieval_ms: float = 0.0  # question embedding + vector search
    embed_ms: float = 0.0  # of retrieval_ms: the question's embedding
    catalog_ms: float = 0.0  # catalog lookup of the retrieved chunks and their KV entries
    rerank_ms: float = 0.0  # --rerank: scoring the candidates with the model over their stored KV
    num_reranked: int = 0  # --rerank: candidates scored (0: no rerank)
    kv_load_ms: float = 0.0  # KV read (RAM tier or shard + checksum) + cache assembly
    kv_read_ms: float = 0.0  # of kv_load: reading (and verifying) stored KV
    assemble_ms: float = 0.0  # of kv_load: building the cache (re-rotation and blend included)
    prefill_ms: float = 0.0
    ttft_s: float = 0.0  # from the call to the first answer token
    decode_s: float = 0.0
    total_s: float = 0.0
    finish_reason: str = ""  # "stop" (end of turn) or "length" (max_new_tokens)
    batch_size: int = 1  # questions prefilled and decoded together with this one (same context)
    store_generation: int = 0
    kv_compute_ms: float = 0.0  # of kv_load: computing the KV of chunks the store had none for (misses)
    approximation: str = ""  # --mode approximate: the mode and share it ran as, and what calibration measured
    kv_sources: dict[int, str] = field(default_factory=dict)  # chunk id -> "store", "ram" or "computed"
    warnings: list[str] = field(default_factory=list)

    @property
    def kv_source(self) -> str:
        """Where the chunk KV came from: "computed" if any chunk's was computed now (a miss),
        else "store" if any was read from the store, else "ram"; "" when none was used."""
        sources = set(self.kv_sources.values())
        return next((s for s in ("computed", "store", "ram") if s in sources), "")

    @classmethod
    def of(cls, mode: str, *reports, **more) -> Stats:
        """The stats of an answer built from what produced it: each field of the `reports`
        (dataclasses such as a retrieval's Prompt or the loader's Loaded) that Stats also has,
        their warnings in order, then `more` (which wins)."""
        names = {f.name for f in fields(cls)} - {"mode", "warnings"}
        values: dict = {}
        warnings: list[str] = []
        for report in reports:
            assert is_dataclass(report), f"{type(report).__name__} is not a dataclass"
            values |= {f.name: copy.copy(getattr(report, f.name)) for f in fields(report) if f.name in names}
            warnings += getattr(report, "warnings", [])
        return cls(mode=mode, **{"warnings": warnings, **values, **more})

    @property
    def is_approximate(self) -> bool:
        """Whether the answer may differ from a full prefill's by the mode's design (not only
        by float rounding): every mode but exact, full and fallback."""
        return self.mode not in ("exact", "full", "fallback")

    @property
    def prompt_tokens(self) -> int:
        return self.reused_tokens + self.recomputed_tokens + self.computed_tokens

    def to_dict(self) -> dict:
        """The fields, and what they imply: kv_source, prompt_tokens, approximate (JSON-ready)."""
        return {
            **asdict(self),
            "kv_sources": {str(k): v for k, v in self.kv_sources.items()},
            "kv_source": self.kv_source,
            "prompt_tokens": self.prompt_tokens,
            "approximate": self.is_approximate,
        }


def timings(done, start: float) -> dict:
    """The Stats fields of a finished `ragkv.model.generate.Generated` started at `start`."""
    return {
        "prefill_ms": done.prefill_s * 1000.0,
        "ttft_s": done.first_token_s,
        "finish_reason": done.finish_reason,
        "generated_tokens": len(done.token_ids),
        "decode_s": done.decode_s,
        "total_s": time.perf_counter() - start,
    }


@dataclass
class Answer:
    question: str
    text: str
    token_ids: list[int]
    sources: list[Source]
    stats: Stats
    prompt_ids: list[int] = field(default_factory=list, repr=False)  # the exact prompt, for comparisons

    def to_dict(self) -> dict:
        """`ragkv ask --json`: the question and answer, and the reply block (`reply`)."""
        return {"question": self.question, "answer": self.text, **self.reply()}

    def reply(self, warnings: list[str] | tuple[str, ...] = (), **more) -> dict:
        """What every reply carries of this answer (see `reply`): its token ids, then sources and stats."""
        return {"token_ids": self.token_ids, **reply(self.sources, self.stats, warnings, **more)}


def reply(sources: list[Source], stats: Stats, warnings: list[str] | tuple[str, ...] = (), **more) -> dict:
    """The one reply builder: the sources and stats of an answer (and `warnings` the front adds
    to the answer's own), as `ragkv ask --json`, the OpenAI fronts' `ragkv` block (in the JSON
    reply and the last SSE chunk) and the framework adapters' metadata all carry them; `more`:
    what one of them adds (the front's prompt size, whether a kept conversation served)."""
    return {
        "sources": [asdict(s) for s in sources],
        "stats": {**stats.to_dict(), **({"warnings": [*stats.warnings, *warnings]} if warnings else {})},
        **more,
    }


@dataclass
class Savings:
    """Cumulative prefill accounting over a run: what a system without a KV store would have
    prefilled (every prompt token) against what was prefilled (computed + recomputed)."""

    requests: int = 0
    prompt_tokens: int = 0
    prefilled_tokens: int = 0

    def add(self, stats: Stats) -> None:
        self.requests += 1
        self.prompt_tokens += stats.prompt_tokens
        self.prefilled_tokens += stats.computed_tokens + stats.recomputed_tokens

    @property
    def saved_pct(self) -> float:
        return 100.0 * (1 - self.prefilled_tokens / self.prompt_tokens) if self.prompt_tokens else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "saved_pct": round(self.saved_pct, 1)}


class AnswerStream:
    """Iterate for text deltas as they are generated; `.answer` holds the `Answer` afterwards."""

    def __init__(self, steps: Generator[str, None, Answer]):
        self._steps = steps
        self.answer: Answer | None = None

    def __iter__(self) -> Iterator[str]:
        self.answer = yield from self._steps

    def drain(self) -> Answer:
        """Iterate the rest of the stream, discarding its text; its `Answer`."""
        for _ in self:
            pass
        return self.result()

    def result(self) -> Answer:
        """The `Answer` of a stream iterated to its end (a stream still going has none)."""
        if self.answer is None:
            raise RuntimeError("the answer stream has not finished: iterate it to its end first")
        return self.answer
