"""The command line's options: each one's flag, default and help, declared once for every
command that takes it, and the groups of them several commands share, each handed to the
command as the one value it builds (`ingest_options`: model and ingest settings;
`answer_options`: how an answer is generated; `retrieval_options`: how candidates are found)."""

from __future__ import annotations

import os

import typer

from ragkv.cli.app import OptionGroup
from ragkv.core.config import (
    DEFAULT_EMBEDDER,
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_MODEL,
    DEFAULT_NO_REPEAT_NGRAM,
    DEFAULT_REPETITION_PENALTY,
    DEFAULT_RERANK,
    DEFAULT_RETRIEVAL,
    DEFAULT_SPAN_TOKENS,
    DEFAULT_STORE,
    DEFAULT_SYSTEM_PROMPT,
    DTYPES,
    IngestSettings,
    ModelSettings,
    parse_size,
)

StoreOption = typer.Option(
    DEFAULT_STORE,
    "--store",
    "-s",
    envvar="RAGKV_STORE",
    help="Store: a directory, or s3://BUCKET/PREFIX (AWS credentials and AWS_ENDPOINT_URL "
    "from the environment) (env RAGKV_STORE).",
)
EngineOption = typer.Option(
    "ragkv",
    "--engine",
    help="What runs the model: ragkv (its own engine, in this process; 'local' is its old name), ray (a Ray "
    "Data job of it: joins RAY_ADDRESS, else starts Ray here; pip install 'ragkv[ray]') or vllm (vLLM's "
    "offline engine computes the chunks' KV; see --vllm-python).",
)
VllmPythonOption = typer.Option(
    None,
    "--vllm-python",
    envvar="RAGKV_VLLM_PYTHON",
    help="--engine vllm: the python that has vLLM (default: this one).",
)
WorkersOption = typer.Option(
    0, "--workers", help="With --engine ray: model actors (0: one per GPU, else one per 2 CPUs)."
)
JsonOption = typer.Option(False, "--json", help="Print one JSON object instead of text (for scripts).")
DeviceOption = typer.Option("auto", "--device", help="auto (CUDA when available), cpu or cuda.")
RerankOption = typer.Option(
    DEFAULT_RERANK,
    "--rerank",
    help="Retrieve this many candidates, score each by how likely the model finds the question after it "
    "(over its stored KV: one batched question prefill), keep the best. 0: retrieval order.",
)
RerankerOption = typer.Option(
    "kv",
    "--reranker",
    help="What scores the --rerank candidates: kv (the model over their stored KV), a cross-encoder (a "
    "sentence-transformers CrossEncoder folder or hub id, e.g. cross-encoder/ms-marco-MiniLM-L6-v2: reads "
    "question and chunk text together), or kv+MODEL (kv first, then the cross-encoder on its best 2 x top-k).",
)
RetrievalOption = typer.Option(
    DEFAULT_RETRIEVAL,
    "--retrieval",
    help="How candidates are found: dense (the embedder's vectors), lexical (BM25 over the chunks' words) "
    "or hybrid (both, fused).",
)
FilterOption = typer.Option(
    None,
    "--filter",
    help="Only documents matching FIELD OP VALUE (repeat: all must match; join comparisons with 'or' for "
    "either). Fields: id, path, title, modified, format, source, or a jsonl record's own; OP: = != > >= < <= "
    "(= and != take * and ?). E.g. --filter 'path=runbooks/* or team=ops' --filter 'year>=2025'.",
)


ModelOption = typer.Option(
    DEFAULT_MODEL, "--model", "-m", help="LLM: a local Hugging Face folder, a hub id, or 'smollm2' (bundled)."
)
EmbedderOption = typer.Option(
    DEFAULT_EMBEDDER, "--embedder", help="sentence-transformers folder or hub id (default: bundled all-MiniLM-L6-v2)."
)
QueryPromptOption = typer.Option(
    None,
    "--query-prompt",
    help="Text put before each question when embedding it (default: the embedder's own query prompt, as "
    "sentence-transformers' encode_query applies it; e5 wants 'query: '). Recorded in the store.",
)
DocumentPromptOption = typer.Option(
    None,
    "--document-prompt",
    help="Text put before each chunk when embedding it (default: the embedder's own document prompt, as "
    "encode_document applies it; e5 wants 'passage: '). Recorded in the store; a change re-embeds its chunks.",
)
DtypeOption = typer.Option(
    "auto",
    "--dtype",
    help=f"KV dtype, part of the cache key: auto (float32 on CPU, bfloat16 on CUDA), {', '.join(DTYPES)}.",
)
ChunkTokensOption = typer.Option(512, "--chunk-tokens", help="Most LLM tokens per chunk.")
SystemPromptOption = typer.Option(
    DEFAULT_SYSTEM_PROMPT, "--system-prompt", help="System prompt, computed once and part of every cache key."
)
KvDtypeOption = typer.Option(
    "auto",
    "--kv-dtype",
    help="How KV is stored: auto (as computed: lossless), or "
    "bfloat16, float16, int8, int4, int2 (smaller, approximate, named in every answer's stats; "
    "benchmarks/results/kv_dtype.md measures each).",
)
SpanTokensOption = typer.Option(
    DEFAULT_SPAN_TOKENS,
    "--span-tokens",
    help="Compute each document's chunks as one sequence, a new span starting where "
    "the next chunk would pass this many tokens, so `ask --context span` loads a "
    "hit with the chunks before it exactly. 0: each chunk on its own.",
)
BatchTokensOption = typer.Option(0, "--batch-tokens", help="Padded tokens per forward (0: 2048 on CPU, 16384 on CUDA).")
WaitOption = typer.Option(
    False, "--wait", help="If another process is writing the store, wait for it instead of failing."
)
QuietOption = typer.Option(False, "--quiet", "-q", help="No progress bars.")
PathsArgument = typer.Argument(..., help="Files or directories: .txt .md .rst .html .jsonl.")
ModeOption = typer.Option(
    "exact",
    "--mode",
    help="With several chunks: exact (equals a full prefill; the "
    "first chunk's KV, or the hits' spans, from the store, the rest prefilled), or approximate "
    "(faster: the mode and share `ragkv calibrate` measured reaching its target on this store, "
    "or exact when none did; query 20% on a store never calibrated). The approximate modes: "
    "concat (every chunk's stored KV, re-rotated), blend (concat, then the most-deviating "
    "tokens recomputed, chosen layer by layer), epic (concat, then the first tokens of every "
    "chunk after the first recomputed), query (concat, then the tokens the question attends to "
    "most recomputed), ape (concat, the later chunks' attention scaled down; ask and chat "
    "only). benchmarks/results/approximate.md measures each.",
)
ContextOption = typer.Option(
    "span",
    "--context",
    help="What a retrieved chunk brings into the prompt: chunk (itself), "
    "span (with the chunks of its span before it: exact from the store when ingested with "
    "--span-tokens), document (its whole span).",
)
OrderOption = typer.Option(
    "retrieval",
    "--order",
    help="The retrieved chunks' order in the prompt: retrieval (best first), or reuse (the chunk, or "
    "span of chunks, whose stored KV is the most tokens first: --mode exact loads the first from the "
    "store and computes the rest, and a recurrent model's state can only continue the first).",
)
BlendRatioOption = typer.Option(
    None,
    "--blend-ratio",
    help="blend, epic: share of context tokens recomputed "
    "(default: 15% for blend, 5% for epic; 1.0: all, equals exact).",
    show_default=False,
)
ApeScaleOption = typer.Option(
    0.7,
    "--ape-scale",
    help="ape: multiply the attention to every chunk after the first by this (1.0: none, equals concat).",
)
MaxNewTokensOption = typer.Option(
    DEFAULT_MAX_NEW_TOKENS, "--max-new-tokens", help="Most tokens to generate per answer."
)
RepetitionPenaltyOption = typer.Option(
    DEFAULT_REPETITION_PENALTY,
    "--repetition-penalty",
    help="Penalise tokens the answer already used (1.0: off). The context is "
    "never penalised: answers may copy from it freely.",
)
NoRepeatNgramOption = typer.Option(
    DEFAULT_NO_REPEAT_NGRAM,
    "--no-repeat-ngram",
    help="The answer never repeats a run of this many of its own tokens (0: off).",
)
TemperatureOption = typer.Option(0.0, "--temperature", help="0: greedy (deterministic, the default); above 0 samples.")
TopPOption = typer.Option(
    1.0, "--top-p", help="With --temperature: sample from the smallest set of tokens holding this much probability."
)
SeedOption = typer.Option(None, "--seed", help="With --temperature: the same seed gives the same answer.")
StopOption = typer.Option(None, "--stop", help="End the answer where this text appears (repeatable; not shown).")


ModelOverrideOption = typer.Option(None, "--model", "-m", help="Override the model the store was built with.")
EmbedderOverrideOption = typer.Option(None, "--embedder", help="Override the embedder the store was built with.")
DtypeChoiceOption = typer.Option(
    None, "--dtype", help="Which of the store's dtypes to use (default: the last ingested)."
)
KvDtypeChoiceOption = typer.Option(None, "--kv-dtype", help="Which stored KV form to use when the store holds several.")
MaxDocBytesOption = typer.Option(
    None,
    "--max-doc-bytes",
    help="Skip (and list) documents with more text than this (default 8MiB); a jsonl file's records count one by one.",
    show_default=False,
)

CalibrateOption = typer.Option(
    False,
    "--calibrate",
    help="Then measure what --mode approximate runs as on this store (`ragkv calibrate` with its defaults); "
    "without it a store never calibrated runs query 20% unmeasured.",
)


def _ingest_settings(
    model,
    embedder,
    device,
    dtype,
    chunk_tokens,
    system_prompt,
    batch_tokens,
    kv_dtype,
    span_tokens,
    max_doc_bytes,
    calibrate,
    query_prompt,
    document_prompt,
) -> tuple[ModelSettings, IngestSettings]:
    limit = {} if max_doc_bytes is None else {"max_document_bytes": parse_size(max_doc_bytes, "--max-doc-bytes")}
    return (
        ModelSettings(
            model=model,
            embedder=embedder,
            device=device,
            dtype=dtype,
            query_prompt=query_prompt,
            document_prompt=document_prompt,
        ),
        IngestSettings(
            chunk_tokens=chunk_tokens,
            system_prompt=system_prompt,
            batch_tokens=batch_tokens,
            kv_dtype=kv_dtype,
            span_tokens=span_tokens,
            calibrate=calibrate,
            **limit,
        ),
    )


ingest_options = OptionGroup(
    "settings",
    (
        ("model", str, ModelOption),
        ("embedder", str, EmbedderOption),
        ("device", str, DeviceOption),
        ("dtype", str, DtypeOption),
        ("chunk_tokens", int, ChunkTokensOption),
        ("system_prompt", str, SystemPromptOption),
        ("batch_tokens", int, BatchTokensOption),
        ("kv_dtype", str, KvDtypeOption),
        ("span_tokens", int, SpanTokensOption),
        ("max_doc_bytes", str | None, MaxDocBytesOption),
        ("calibrate", bool, CalibrateOption),
        ("query_prompt", str | None, QueryPromptOption),
        ("document_prompt", str | None, DocumentPromptOption),
    ),
    _ingest_settings,
)


def _answer(
    max_new_tokens,
    mode,
    context,
    order,
    blend_ratio,
    repetition_penalty,
    no_repeat_ngram,
    temperature,
    top_p,
    seed,
    stop,
):
    """`AskSettings.from_dict`'s keys for how an answer is generated (decoding's among them, flat)."""
    return {
        "max_new_tokens": max_new_tokens,
        "mode": mode,
        "context": context,
        "order": order,
        "blend_ratio": blend_ratio,
        "repetition_penalty": repetition_penalty,
        "no_repeat_ngram": no_repeat_ngram,
        "temperature": temperature,
        "top_p": top_p,
        "seed": seed,
        "stop": tuple(stop or ()),
    }


answer_options = OptionGroup(
    "answering",
    (
        ("max_new_tokens", int, MaxNewTokensOption),
        ("mode", str, ModeOption),
        ("context", str, ContextOption),
        ("order", str, OrderOption),
        ("blend_ratio", float | None, BlendRatioOption),
        ("repetition_penalty", float, RepetitionPenaltyOption),
        ("no_repeat_ngram", int, NoRepeatNgramOption),
        ("temperature", float, TemperatureOption),
        ("top_p", float, TopPOption),
        ("seed", int | None, SeedOption),
        ("stop", list[str] | None, StopOption),
    ),
    _answer,
)

retrieval_options = OptionGroup(
    "retrieval",
    (
        ("retrieval", str, RetrievalOption),
        ("filters", list[str] | None, FilterOption),
        ("rerank", int, RerankOption),
        ("reranker", str, RerankerOption),
    ),
    lambda retrieval, filters, rerank, reranker: {
        "retrieval": retrieval,
        "filters": tuple(filters or ()),
        "rerank": rerank,
        "reranker": reranker,
    },
)


def _runner(engine: str, workers: int, vllm_python: str | None) -> dict:
    """The offline engine's options; --vllm-python is where `--engine vllm` finds vLLM
    (ragkv.pipelines.engines.vllm_engine reads the variable)."""
    if vllm_python:
        os.environ["RAGKV_VLLM_PYTHON"] = vllm_python
    return {"engine": engine, "workers": workers}


runner_options = OptionGroup(
    "runner",
    (("engine", str, EngineOption), ("workers", int, WorkersOption), ("vllm_python", str | None, VllmPythonOption)),
    _runner,
)
