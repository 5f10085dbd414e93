"""The `ragkv` command: a thin layer over the library. Each command parses its options,
calls one library function and prints the result; errors become one line and an exit code
in one place (`_Group`)."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import typer
from typer.core import TyperGroup

try:  # typer 0.2x carries its own copy of click, whose exceptions its parser raises
    from typer._click.exceptions import ClickException, UsageError
except ImportError:  # older typer runs on click itself
    from click.exceptions import ClickException, UsageError

from ragkv import output as text
from ragkv.config import (
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
    AskSettings,
    DecodeSettings,
    SearchSettings,
)
from ragkv.errors import InputError, RagkvError


class _StderrHandler(logging.Handler):
    """Our own messages (the one-time model conversion, waiting for a lock, warnings) to
    whatever stderr is now (test runners swap it)."""

    def emit(self, record):
        sys.stderr.write(self.format(record) + "\n")


def _log_to_stderr() -> None:
    logger = logging.getLogger("ragkv")
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        logger.addHandler(_StderrHandler())
    logger.setLevel(logging.INFO)
    logger.propagate = False


class _Group(TyperGroup):
    """Every failure ends here as one `error: ...` line and an exit code (see ragkv.errors):
    ragkv's own errors, option parsing errors (2), and, as a last resort, anything else, named
    as the bug it is (1; RAGKV_TRACEBACK=1 shows where)."""

    def invoke(self, ctx):
        _log_to_stderr()
        try:
            return super().invoke(ctx)
        except RagkvError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(exc.exit_code) from None
        except (typer.Exit, typer.Abort, ClickException, KeyboardInterrupt):
            raise
        except BrokenPipeError:  # the reader of our output went away (`ragkv ask ... | head`)
            raise typer.Exit(1) from None
        except Exception as exc:
            if os.environ.get("RAGKV_TRACEBACK"):
                raise
            typer.echo(
                f"error: internal error {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''} "
                "(a bug in ragkv: please report it; RAGKV_TRACEBACK=1 shows where)",
                err=True,
            )
            raise typer.Exit(1) from None

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        """As click's, but a usage error is one line naming the problem and the --help to read."""
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except UsageError as exc:
            where = exc.ctx.command_path if exc.ctx else "ragkv"
            typer.echo(f"error: {exc.format_message()} (see: {where} --help)", err=True)
            sys.exit(exc.exit_code)
        except ClickException as exc:
            typer.echo(f"error: {exc.format_message()}", err=True)
            sys.exit(exc.exit_code)
        except typer.Abort:
            typer.echo("error: aborted", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


app = typer.Typer(
    cls=_Group,
    help="Compute each document's KV cache once; answer questions by prefilling only the question.\n\n"
    "  ragkv ingest data/ --store ./kvstore\n\n"
    '  ragkv ask "How do I rotate the API key?" --store ./kvstore\n\n'
    "Nightly: ragkv reindex data/ --store ./kvstore --report report.json",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _show_version(value: bool) -> None:
    if value:
        from ragkv import __version__
        from ragkv.formats import STORE_FORMAT

        typer.echo(f"ragkv {__version__} (store format {STORE_FORMAT})")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False,
        "--version",
        is_eager=True,
        callback=_show_version,
        help="Print ragkv's version and the store format it writes, and exit.",
    ),
):
    """Compute each document's KV cache once; answer questions by prefilling only the question."""


StoreOption = typer.Option(
    DEFAULT_STORE,
    "--store",
    "-s",
    envvar="RAGKV_STORE",
    help="Store: a directory, or s3://BUCKET/PREFIX (AWS credentials and AWS_ENDPOINT_URL "
    "from the environment) (env RAGKV_STORE).",
)
EngineOption = typer.Option(
    "local",
    "--engine",
    help="local (this process), ray (a Ray Data job: joins RAY_ADDRESS, "
    "else starts Ray here; pip install 'ragkv[ray]') or vllm (vLLM's "
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
RetrievalOption = typer.Option(
    DEFAULT_RETRIEVAL,
    "--retrieval",
    help="How candidates are found: dense (the embedder's vectors), lexical (BM25 over the chunks' words) "
    "or hybrid (both, fused).",
)
FilterOption = typer.Option(
    None,
    "--filter",
    help="Only documents matching FIELD OP VALUE (repeat: all must match). Fields: id, path, title, modified, "
    "format, source, or a jsonl record's own; OP: = != > >= < <= (= and != take * and ?). "
    "E.g. --filter 'path=runbooks/*' --filter 'year>=2025'.",
)


def _quiet_libraries() -> None:
    """Library chatter (transformers' warnings and progress bars) off."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


ModelOption = typer.Option(
    DEFAULT_MODEL, "--model", "-m", help="LLM: a local Hugging Face folder, a hub id, or 'smollm2' (bundled)."
)
EmbedderOption = typer.Option(
    DEFAULT_EMBEDDER, "--embedder", help="sentence-transformers folder or hub id (default: bundled all-MiniLM-L6-v2)."
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


MaxDocBytesOption = typer.Option(
    None,
    "--max-doc-bytes",
    help="Skip (and list) documents with more text than this (default 8MiB); a jsonl file's records count one by one.",
    show_default=False,
)


def _settings(
    model, embedder, device, dtype, chunk_tokens, system_prompt, batch_tokens, kv_dtype, span_tokens, max_doc_bytes
):
    from ragkv.config import IngestSettings, ModelSettings, parse_size

    limit = {} if max_doc_bytes is None else {"max_document_bytes": parse_size(max_doc_bytes, "--max-doc-bytes")}
    return (
        ModelSettings(model=model, embedder=embedder, device=device, dtype=dtype),
        IngestSettings(
            chunk_tokens=chunk_tokens,
            system_prompt=system_prompt,
            batch_tokens=batch_tokens,
            kv_dtype=kv_dtype,
            span_tokens=span_tokens,
            **limit,
        ),
    )


@app.command()
def ingest(
    paths: list[Path] = PathsArgument,
    store: str = StoreOption,
    model: str = ModelOption,
    embedder: str = EmbedderOption,
    dtype: str = DtypeOption,
    device: str = DeviceOption,
    chunk_tokens: int = ChunkTokensOption,
    system_prompt: str = SystemPromptOption,
    batch_tokens: int = BatchTokensOption,
    kv_dtype: str = KvDtypeOption,
    span_tokens: int = SpanTokensOption,
    max_doc_bytes: str | None = MaxDocBytesOption,
    kv_budget: str | None = typer.Option(
        None,
        "--kv-budget",
        help="Most bytes of KV the store keeps (e.g. 20GB, 512MiB), kept by popularity: a chunk "
        "without KV has it computed on its first question and stored if it earns a place. Saved in the store; change "
        "it later with `ragkv budget`. Default: the store's budget, else none (all KV kept).",
        show_default=False,
    ),
    precompute: str = typer.Option(
        "all",
        "--precompute",
        help="Chunk KV to compute now: all (every chunk, or as much as the budget holds, most "
        "asked first), none (only on questions' misses), or a size (e.g. 2GB).",
    ),
    prune: bool = typer.Option(False, "--prune", help="Also remove stored documents that are not under PATHS."),
    engine: str = EngineOption,
    workers: int = WorkersOption,
    vllm_python: str | None = VllmPythonOption,
    wait: bool = WaitOption,
    json_out: bool = JsonOption,
    quiet: bool = QuietOption,
):
    """Read, chunk, embed documents and store each chunk's KV cache. Re-running skips what is stored."""
    _quiet_libraries()
    _use_vllm_python(vllm_python)
    import dataclasses

    import ragkv
    from pipelines.progress import default_reporter
    from ragkv.config import parse_size

    model_settings, settings = _settings(
        model, embedder, device, dtype, chunk_tokens, system_prompt, batch_tokens, kv_dtype, span_tokens, max_doc_bytes
    )
    limits = {"all": None, "none": 0}
    settings = dataclasses.replace(
        settings,
        kv_budget=parse_size(kv_budget, "--kv-budget") if kv_budget is not None else None,
        precompute=limits[precompute]
        if precompute in limits
        else parse_size(precompute, "--precompute (all, none or a size)"),
    )
    report = ragkv.ingest(
        paths,
        store,
        model=model_settings,
        settings=settings,
        reporter=default_reporter(quiet or json_out),
        wait=wait,
        prune=prune,
        engine=engine,
        workers=workers,
    )
    _print(report.to_dict(), json_out, text.ingest_lines)


def _use_vllm_python(python: str | None) -> None:
    """--vllm-python: where --engine vllm finds vLLM (pipelines.vllm_engine reads the variable)."""
    if python:
        os.environ["RAGKV_VLLM_PYTHON"] = python


@app.command()
def reindex(
    paths: list[Path] = PathsArgument,
    store: str = StoreOption,
    model: str = ModelOption,
    embedder: str = EmbedderOption,
    dtype: str = DtypeOption,
    device: str = DeviceOption,
    chunk_tokens: int = ChunkTokensOption,
    system_prompt: str = SystemPromptOption,
    batch_tokens: int = BatchTokensOption,
    kv_dtype: str = KvDtypeOption,
    span_tokens: int = SpanTokensOption,
    max_doc_bytes: str | None = MaxDocBytesOption,
    gc: bool = typer.Option(True, "--gc/--no-gc", help="Reclaim space of retired KV afterwards."),
    check: bool = typer.Option(True, "--verify/--no-verify", help="Verify every entry afterwards."),
    report_file: Path | None = typer.Option(None, "--report", help="Also write the JSON report to this file."),
    engine: str = EngineOption,
    workers: int = WorkersOption,
    vllm_python: str | None = VllmPythonOption,
    wait: bool = WaitOption,
    json_out: bool = JsonOption,
    quiet: bool = QuietOption,
):
    """The nightly job: make the store match PATHS exactly (add, recompute, remove), gc, verify.

    Exit code 0 when the store verifies; 4 when it found problems; other codes as for ingest."""
    _quiet_libraries()
    _use_vllm_python(vllm_python)
    from pipelines.nightly import run_nightly
    from pipelines.progress import default_reporter

    model_settings, settings = _settings(
        model, embedder, device, dtype, chunk_tokens, system_prompt, batch_tokens, kv_dtype, span_tokens, max_doc_bytes
    )
    output = text.OutputFile(report_file, "--report") if report_file else None
    report = run_nightly(
        paths,
        store,
        model=model_settings,
        settings=settings,
        gc=gc,
        check=check,
        wait=wait,
        reporter=default_reporter(quiet or json_out),
        engine=engine,
        workers=workers,
    )
    if output:
        with output:
            output.write(json.dumps(report.to_dict(), indent=2))
    if json_out:
        typer.echo(json.dumps(report.to_dict()))
    else:
        _echo(text.ingest_lines(report.ingest))
        _echo(text.gc_lines(report.gc) if report.gc else [])
        _echo(text.verify_lines(report.verify) if report.verify else [])
    raise typer.Exit(report.exit_code)


@app.command()
def gc(
    store: str = StoreOption,
    other_models: bool = typer.Option(
        False, "--other-models", help="Also drop KV of every model except the one last ingested with."
    ),
    wait: bool = WaitOption,
    json_out: bool = JsonOption,
):
    """Remove KV no document uses, rewrite mostly-dead shards, delete unreferenced shard files, and
    compact: the catalog's delta into a new base, the vector segments into one (IVF, retrained, for a
    large store). Costs what the store holds; run it nightly, not per change."""
    from store import collect_garbage

    _print(collect_garbage(store, other_models=other_models, wait=wait).to_dict(), json_out, text.gc_lines)


@app.command()
def verify(
    store: str = StoreOption,
    repair: bool = typer.Option(False, "--repair", help="Recompute bad entries with the model that made them."),
    device: str = DeviceOption,
    json_out: bool = JsonOption,
):
    """Check every KV entry's checksum, every chunk's link, and the vector index. Exit 4 on problems."""
    from ragkv.config import resolve_device
    from store import open_snapshot
    from store import verify as verify_store

    if repair:
        _quiet_libraries()
        from pipelines.repair import repair as repair_store

        fixed = repair_store(store, device=resolve_device(device))
        _echo([] if json_out else text.repair_lines(fixed))
    with open_snapshot(store, require_documents=False, lenient=True) as snapshot:
        report = verify_store(snapshot).to_dict()
    _print(report, json_out, text.verify_lines)
    raise typer.Exit(0 if report["ok"] else 4)


@app.command()
def ask(
    question: str = typer.Argument(..., help="The question."),
    store: str = StoreOption,
    top_k: int = typer.Option(
        1, "--top-k", "-k", help="Chunks to retrieve; the first comes from the store, the rest are prefilled live."
    ),
    max_new_tokens: int = MaxNewTokensOption,
    no_cache: bool = typer.Option(
        False, "--no-cache", help="Full prefill of the same prompt (to compare with the cached path)."
    ),
    mode: str = ModeOption,
    context: str = ContextOption,
    blend_ratio: float | None = BlendRatioOption,
    ape_scale: float = ApeScaleOption,
    doc: str | None = typer.Option(None, "--doc", help="Retrieve only from this document id."),
    retrieval: str = RetrievalOption,
    filters: list[str] | None = FilterOption,
    rerank: int = RerankOption,
    json_out: bool = JsonOption,
    model: str | None = typer.Option(None, "--model", "-m", help="Override the model the store was built with."),
    embedder: str | None = typer.Option(None, "--embedder", help="Override the embedder the store was built with."),
    dtype: str | None = typer.Option(
        None, "--dtype", help="Which of the store's dtypes to use (default: the last ingested)."
    ),
    kv_dtype: str | None = typer.Option(
        None, "--kv-dtype", help="Which stored KV form to use when the store holds several."
    ),
    device: str = DeviceOption,
    repetition_penalty: float = RepetitionPenaltyOption,
    no_repeat_ngram: int = NoRepeatNgramOption,
    temperature: float = TemperatureOption,
    top_p: float = TopPOption,
    seed: int | None = SeedOption,
    stop: list[str] | None = StopOption,
):
    """Answer a question from the store: retrieve, load the chunk's KV, prefill only the question.

    Decoding is greedy (deterministic) with light repetition control; the cached answer and
    --no-cache decode alike, so in float32 they are token for token the same."""
    _quiet_libraries()
    import ragkv

    if not question.strip():
        raise InputError("the question is empty; ask something")
    decoding = _decoding(repetition_penalty, no_repeat_ngram, temperature, top_p, seed, stop)
    settings = AskSettings(
        top_k=top_k,
        max_new_tokens=max_new_tokens,
        use_cache=not no_cache,
        mode=mode,
        context=context,
        blend_ratio=blend_ratio,
        ape_scale=ape_scale,
        doc_ids=(doc,) if doc else None,
        retrieval=retrieval,
        filters=tuple(filters or ()),
        rerank=rerank,
        decoding=decoding,
    )
    _check_filter_fields(store, settings.search)
    with ragkv.open(store, model=model, embedder=embedder, device=device, dtype=dtype, kv_dtype=kv_dtype) as engine:
        stream = engine.stream(question, settings)
        for delta in stream:
            if not json_out:
                sys.stdout.write(delta)
                sys.stdout.flush()
        answer = stream.answer
    if json_out:
        typer.echo(json.dumps(answer.to_dict()))
        return
    typer.echo("")
    _echo(text.answer_footer(answer), err=True)


def _decoding(repetition_penalty, no_repeat_ngram, temperature, top_p, seed, stop) -> DecodeSettings:
    return DecodeSettings(
        repetition_penalty=repetition_penalty,
        no_repeat_ngram=no_repeat_ngram,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        stop=tuple(stop or ()),
    )


@app.command()
def search(
    question: str | None = typer.Argument(None, help="The question (or give --file)."),
    store: str = StoreOption,
    top_k: int = typer.Option(5, "--top-k", "-k", help="Chunks to return."),
    retrieval: str = RetrievalOption,
    rerank: int = RerankOption,
    filters: list[str] | None = FilterOption,
    doc: str | None = typer.Option(None, "--doc", help="Search only this document id."),
    questions_file: Path | None = typer.Option(
        None, "--file", help='JSONL of {"id", "question", "doc"?}: one JSON line of {"id", "results"} per question.'
    ),
    json_out: bool = JsonOption,
    device: str = DeviceOption,
):
    """Rank the store's chunks for a question, without generating: what `ask` would read.

    Each result has the document id, chunk index, chunk id, score and text (--json). With
    --file, many questions are searched in one process (evaluations, batch jobs)."""
    _quiet_libraries()
    import ragkv
    from ragkv.batch import Question, read_questions, search_all

    if (question is None) == (questions_file is None):
        raise InputError("give a question or --file questions.jsonl (one of the two)")
    if question is not None and not question.strip():
        raise InputError("the question is empty; ask something")
    settings = SearchSettings(top_k, retrieval, rerank, filters=tuple(filters or ()))  # checked before any model loads
    _check_filter_fields(store, settings)
    items, errors = read_questions(questions_file) if questions_file else ([Question("1", question or "", doc)], [])
    with ragkv.open(store, device=device) as engine:
        for outcome in errors:
            typer.echo(json.dumps(outcome.to_dict()))
        for found in search_all(engine, items, settings):
            if questions_file or json_out:
                typer.echo(json.dumps(found if questions_file else {"question": question, **found}))
            elif "error" in found:
                raise InputError(found["error"])
            else:
                _echo(text.search_lines(found["results"]))
                _echo([f"warning: {warning}" for warning in found.get("warnings", [])], err=True)


def _check_filter_fields(store: str, settings: SearchSettings) -> None:
    """A filter naming a field no document of the store has is refused before any model loads."""
    if not settings.filters:
        return
    from ragkv.filters import check_fields
    from store import open_snapshot

    with open_snapshot(store, require_documents=False) as snapshot:
        check_fields(settings.conditions, snapshot.catalog.metadata_fields())


@app.command()
def batch(
    questions: Path = typer.Argument(
        ..., help='JSONL: one {"id", "question", "doc"?} per line ("doc" pins a document).'
    ),
    out: Path = typer.Option(..., "--out", "-o", help="Where to write one JSON answer (or error) per line."),
    store: str = StoreOption,
    top_k: int = typer.Option(1, "--top-k", "-k", help="Chunks per question."),
    max_new_tokens: int = MaxNewTokensOption,
    mode: str = ModeOption,
    context: str = ContextOption,
    blend_ratio: float | None = BlendRatioOption,
    max_batch: int = typer.Option(16, "--max-batch", help="Most questions decoded together."),
    retrieval: str = RetrievalOption,
    filters: list[str] | None = FilterOption,
    rerank: int = RerankOption,
    device: str = DeviceOption,
    json_out: bool = JsonOption,
    quiet: bool = QuietOption,
    repetition_penalty: float = RepetitionPenaltyOption,
    no_repeat_ngram: int = NoRepeatNgramOption,
    temperature: float = TemperatureOption,
    top_p: float = TopPOption,
    seed: int | None = SeedOption,
    stop: list[str] | None = StopOption,
):
    """Answer a file of questions, decoded together on the continuous batcher (as `ragkv serve`
    does): each answer equals `ragkv ask`'s, and is counted and logged like one."""
    _quiet_libraries()
    import ragkv
    from pipelines.progress import default_reporter
    from ragkv.batch import read_questions, run_batch

    if max_batch < 1:
        raise InputError(f"--max-batch must be at least 1, got {max_batch}")
    decoding = _decoding(repetition_penalty, no_repeat_ngram, temperature, top_p, seed, stop)
    settings = AskSettings(
        top_k=top_k,
        max_new_tokens=max_new_tokens,
        mode=mode,
        context=context,
        blend_ratio=blend_ratio,
        retrieval=retrieval,
        filters=tuple(filters or ()),
        rerank=rerank,
        decoding=decoding,
    )
    _check_filter_fields(store, settings.search)
    items, errors = read_questions(questions)
    sink = text.OutputFile(out, "--out")
    with ragkv.open(store, device=device) as engine, sink:
        reporter = default_reporter(quiet or json_out)
        summary = run_batch(engine, items, errors, settings, sink.write, reporter, max_batch=max_batch)
    if json_out:
        typer.echo(json.dumps(summary))
        return
    _echo(text.batch_lines(summary, out))
    _echo([f"  {error}" for error in summary["errors"]], err=True)


@app.command()
def chat(
    store: str = StoreOption,
    top_k: int = typer.Option(
        1, "--top-k", "-k", help="Chunks the first message retrieves (kept for the conversation)."
    ),
    max_new_tokens: int = MaxNewTokensOption,
    mode: str = ModeOption,
    context: str = ContextOption,
    blend_ratio: float | None = BlendRatioOption,
    ape_scale: float = ApeScaleOption,
    model: str | None = typer.Option(None, "--model", "-m", help="Override the model the store was built with."),
    device: str = DeviceOption,
    repetition_penalty: float = RepetitionPenaltyOption,
    no_repeat_ngram: int = NoRepeatNgramOption,
    temperature: float = TemperatureOption,
    top_p: float = TopPOption,
    seed: int | None = SeedOption,
    stop: list[str] | None = StopOption,
):
    """An interactive conversation. The first message retrieves its context; every later turn
    reuses the cache of the whole conversation and prefills only the new message.

    Commands: /reset starts over (and retrieves again), /sources shows the context, /quit (or EOF) ends."""
    _quiet_libraries()
    import ragkv

    decoding = _decoding(repetition_penalty, no_repeat_ngram, temperature, top_p, seed, stop)
    settings = AskSettings(
        top_k=top_k,
        max_new_tokens=max_new_tokens,
        mode=mode,
        context=context,
        blend_ratio=blend_ratio,
        ape_scale=ape_scale,
        decoding=decoding,
    )
    try:
        import readline  # noqa: F401 - line editing and history for input()
    except ImportError:
        pass
    with ragkv.open(store, model=model, device=device) as engine:
        conversation = engine.conversation(settings)
        typer.echo("Ask a question (/reset, /sources, /quit).", err=True)
        while True:
            try:
                message = input("> ").strip()
            except EOFError:
                break
            if message in ("/quit", "/exit"):
                break
            if message == "/reset":
                conversation.reset()
                continue
            if message == "/sources":
                _echo([text.source_line(s) for s in conversation.sources], err=True)
                continue
            if not message:
                continue
            stream = conversation.stream(message)
            for delta in stream:
                sys.stdout.write(delta)
                sys.stdout.flush()
            typer.echo("")
            _echo(text.answer_footer(stream.answer, sources=len(conversation.turns) == 1), err=True)


@app.command()
def serve(
    store: str = StoreOption,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind (loopback unless you say otherwise)."),
    port: int = typer.Option(8000, "--port", help="TCP port."),
    api_key: str | None = typer.Option(
        None, "--api-key", envvar="RAGKV_API_KEY", help="Require Authorization: Bearer KEY (env RAGKV_API_KEY)."
    ),
    max_queue: int = typer.Option(16, "--max-queue", help="Requests that may wait to join the batch; more get 503."),
    max_batch: int = typer.Option(
        16,
        "--max-batch",
        help="Requests decoded together (continuous batching: each "
        "forward advances every running answer by one token).",
    ),
    max_batch_tokens: int = typer.Option(
        32768,
        "--max-batch-tokens",
        help="KV tokens the running batch may hold (rows x the longest prompt + "
        "answer); requests beyond it wait. Bounds memory.",
    ),
    prefill_chunk: int = typer.Option(
        256,
        "--prefill-chunk",
        help="Prompt tokens a request prefills per step, so a long prefill never stalls running streams.",
    ),
    max_tokens_cap: int = typer.Option(1024, "--max-tokens-cap", help="Largest max_tokens a request gets."),
    model: str | None = typer.Option(None, "--model", "-m", help="Override the model the store was built with."),
    device: str = DeviceOption,
    engine_name: str = typer.Option(
        "ragkv",
        "--engine",
        help="ragkv (this process runs the model) or vllm (a vLLM "
        "server runs it, loading the store's KV through the ragkv connector; ragkv "
        "retrieves and lays out the prompt in front, with the same API).",
    ),
    vllm_python: str | None = VllmPythonOption,
    vllm_port: int = typer.Option(8100, "--vllm-port", help="--engine vllm: the port vLLM listens on (loopback)."),
    vllm_args: str | None = typer.Option(
        None,
        "--vllm-args",
        help="--engine vllm: more arguments for vLLM's "
        'server, e.g. "--max-model-len 4096 --gpu-memory-utilization 0.8".',
    ),
    write_back: bool = typer.Option(
        True,
        "--write-back/--no-write-back",
        help="Store the KV computed for a retrieved chunk the store lacks (in the "
        "background, within the KV budget), so the next question that uses it "
        "loads it. --no-write-back leaves the store as it is.",
    ),
):
    """Serve the store over HTTP: OpenAI-compatible /v1/chat/completions (streaming too),
    /v1/retrieve, /v1/models, /healthz, /metrics. Picks up re-indexed generations live."""
    _quiet_libraries()
    import ragkv
    from ragkv.api import ServeSettings
    from ragkv.service import serve as serve_engine

    settings = ServeSettings(
        host=host,
        port=port,
        api_key=api_key or None,
        max_queue=max_queue,
        max_batch=max_batch,
        max_tokens_cap=max_tokens_cap,
        max_batch_tokens=max_batch_tokens,
        prefill_chunk=prefill_chunk,
        write_back=write_back,
    )
    announce = lambda line: typer.echo(line, err=True)  # noqa: E731
    if engine_name == "vllm":
        from ragkv.vllm_front import serve_on_vllm

        with ragkv.open(store, model=model, device="cpu", weights=False) as engine:
            serve_on_vllm(engine, store, settings, vllm_python or sys.executable, vllm_port, vllm_args or "", announce)
        return
    if engine_name != "ragkv":
        raise InputError(f"unknown --engine {engine_name!r}; use ragkv or vllm")
    with ragkv.open(store, model=model, device=device, write_back=write_back) as engine:
        serve_engine(engine, store, settings, announce)


@app.command()
def calibrate(
    store: str = StoreOption,
    questions: int = typer.Option(12, "--questions", help="Held-in questions drawn from the store's own chunks."),
    top_k: int = typer.Option(5, "--top-k", "-k", help="Chunks each question retrieves (approximate modes need 2+)."),
    target: float = typer.Option(0.9, "--target", help="First-token agreement with a full prefill to reach."),
    model: str | None = typer.Option(None, "--model", "-m", help="Override the model the store was built with."),
    device: str = DeviceOption,
    json_out: bool = JsonOption,
    quiet: bool = QuietOption,
):
    """Measure the approximate modes against a full prefill on this store and record what
    `--mode approximate` runs as: the fastest mode and recompute share reaching --target
    first-token agreement, or exact answers when none does (faster than exact)."""
    _quiet_libraries()
    from pipelines.calibrate import CalibrateSettings
    from pipelines.calibrate import calibrate as run
    from pipelines.progress import default_reporter

    settings = CalibrateSettings(questions=questions, top_k=top_k, target=target)
    result = run(store, settings, default_reporter(quiet or json_out), model=model, device=device)
    if json_out:
        typer.echo(json.dumps({**json.loads(result.to_json()), "summary": result.describe()}))
        return
    _echo(text.calibrate_lines(result, store))


@app.command()
def budget(
    size: str | None = typer.Argument(
        None,
        help="Most bytes of KV to keep (e.g. 20GB, 512MiB), or 'off'. Omitted: show the budget and what the KV takes.",
    ),
    store: str = StoreOption,
    wait: bool = WaitOption,
    json_out: bool = JsonOption,
):
    """Show or change the store's KV budget. A smaller budget evicts the least-asked chunks' KV now
    (LFU with ageing: each question adds 1, halving every 7 days); they are computed again on a miss."""
    from ragkv.config import parse_size
    from store.budget import budget_status, set_budget

    if size is None:
        report = budget_status(store)
    else:
        report = set_budget(
            store, None if size.strip().lower() in ("off", "none") else parse_size(size, "budget"), wait
        )
    _print(report.to_dict(), json_out, text.budget_lines)


@app.command()
def stats(store: str = StoreOption, json_out: bool = JsonOption):
    """What a store holds: documents, chunks, tokens and bytes per model and dtype, shards, dead bytes."""
    from store import open_snapshot
    from store.stats import store_stats

    with open_snapshot(store, require_documents=False) as snapshot:
        summary = store_stats(snapshot)
    _print(summary, json_out, text.stats_lines)


def _echo(lines: list[str], err: bool = False) -> None:
    for line in lines:
        typer.echo(line, err=err)


def _print(report: dict, json_out: bool, lines) -> None:
    """A report as one JSON object (--json), or as the `lines` (a ragkv.output function) of it."""
    _echo([json.dumps(report)] if json_out else lines(report))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
