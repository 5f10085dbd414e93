"""The `ragkv` command: a thin layer over the library. Each command parses its options,
calls one library function and prints the result; errors become one line and an exit code
in one place (`ragkv.cli.app.CommandGroup`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer

import ragkv.cli.output as text
from ragkv.cli.app import new_app, quiet_libraries
from ragkv.cli.options import (
    ApeScaleOption,
    DeviceOption,
    DtypeChoiceOption,
    EmbedderOverrideOption,
    JsonOption,
    KvDtypeChoiceOption,
    ModelOverrideOption,
    PathsArgument,
    QuietOption,
    StoreOption,
    WaitOption,
    answer_options,
    ingest_options,
    retrieval_options,
    runner_options,
)
from ragkv.cli.serve import serve_options, vllm_front_options
from ragkv.core.config import AskSettings, SearchSettings
from ragkv.core.errors import InputError

if TYPE_CHECKING:
    from ragkv.cli.serve import VllmFront
    from ragkv.serve.api import ServeSettings


app = new_app(
    "Compute each document's KV cache once; answer questions by prefilling only the question.\n\n"
    "  ragkv ingest data/ --store ./kvstore\n\n"
    '  ragkv ask "How do I rotate the API key?" --store ./kvstore\n\n'
    "Nightly: ragkv reindex data/ --store ./kvstore --report report.json"
)


@app.command()
@ingest_options
@runner_options
def ingest(
    paths: list[Path] = PathsArgument,
    store: str = StoreOption,
    kv_budget: str | None = typer.Option(
        None,
        "--kv-budget",
        help="Most bytes of KV the store keeps (e.g. 20GB, 512MiB), by popularity: a chunk without KV has it "
        "computed on its first question, stored if it earns a place (a span stays a prefix of itself: its coldest "
        "tail goes first). Saved in the store; change it with `ragkv budget`. Default: the store's, else none.",
        show_default=False,
    ),
    precompute: str = typer.Option(
        "all",
        "--precompute",
        help="Chunk KV to compute now: all (every chunk, or as much as the budget holds, most "
        "asked first), none (only on questions' misses), or a size (e.g. 2GB).",
    ),
    prune: bool = typer.Option(False, "--prune", help="Also remove stored documents that are not under PATHS."),
    wait: bool = WaitOption,
    json_out: bool = JsonOption,
    quiet: bool = QuietOption,
    *,
    settings: tuple,
    runner: dict,
):
    """Read, chunk, embed documents and store each chunk's KV cache. Re-running skips what is stored."""
    quiet_libraries()
    import dataclasses

    import ragkv
    from ragkv.core.config import parse_precompute, parse_size
    from ragkv.pipelines.progress import default_reporter

    model_settings, ingest_settings = settings
    ingest_settings = dataclasses.replace(
        ingest_settings,
        kv_budget=parse_size(kv_budget, "--kv-budget") if kv_budget is not None else None,
        precompute=parse_precompute(precompute),
    )
    report = ragkv.ingest(
        paths,
        store,
        model=model_settings,
        settings=ingest_settings,
        reporter=default_reporter(quiet or json_out),
        wait=wait,
        prune=prune,
        **runner,
    )
    _print(report.to_dict(), json_out, text.ingest_lines)


@app.command()
@ingest_options
@runner_options
def reindex(
    paths: list[Path] = PathsArgument,
    store: str = StoreOption,
    gc: bool = typer.Option(True, "--gc/--no-gc", help="Reclaim space of retired KV afterwards."),
    check: bool = typer.Option(True, "--verify/--no-verify", help="Verify every entry afterwards."),
    report_file: Path | None = typer.Option(None, "--report", help="Also write the JSON report to this file."),
    wait: bool = WaitOption,
    json_out: bool = JsonOption,
    quiet: bool = QuietOption,
    *,
    settings: tuple,
    runner: dict,
):
    """The nightly job: make the store match PATHS exactly (add, recompute, remove), gc, verify.

    Exit code 0 when the store verifies; 4 when it found problems; other codes as for ingest."""
    quiet_libraries()
    from ragkv.pipelines.nightly import run_nightly
    from ragkv.pipelines.progress import default_reporter

    model, options = settings
    output = text.OutputFile(report_file, "--report") if report_file else None
    reporter = default_reporter(quiet or json_out)
    report = run_nightly(
        paths, store, model=model, settings=options, gc=gc, check=check, wait=wait, reporter=reporter, **runner
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
    from ragkv.store import collect_garbage

    _print(collect_garbage(store, other_models=other_models, wait=wait).to_dict(), json_out, text.gc_lines)


@app.command()
def fold(store: str = StoreOption, wait: bool = WaitOption, json_out: bool = JsonOption):
    """Fold what readers left pending (S3: KV computed on misses) into the store; ingest and reindex fold too."""
    from ragkv.store.kv.writeback import fold as fold_store

    _print(fold_store(store, wait=wait).to_dict(), json_out, text.fold_lines)


@app.command()
def verify(
    store: str = StoreOption,
    repair: bool = typer.Option(False, "--repair", help="Recompute bad entries with the model that made them."),
    device: str = DeviceOption,
    json_out: bool = JsonOption,
):
    """Check every KV entry's checksum, every chunk's link, and the vector index. Exit 4 on problems."""
    from ragkv.core.config import resolve_device
    from ragkv.store import open_snapshot
    from ragkv.store import verify as verify_store

    fixed = None
    if repair:
        quiet_libraries()
        from ragkv.pipelines.repair import repair as repair_store

        fixed = repair_store(store, device=resolve_device(device))
        _echo([] if json_out else text.repair_lines(fixed))
    with open_snapshot(store, require_documents=False, lenient=True) as snapshot:
        report = {**verify_store(snapshot).to_dict(), **({"repair": fixed.to_dict()} if fixed else {})}
    _print(report, json_out, text.verify_lines)
    raise typer.Exit(0 if report["ok"] else 4)


@app.command()
@answer_options
@retrieval_options
def ask(
    question: str = typer.Argument(..., help="The question."),
    store: str = StoreOption,
    top_k: int = typer.Option(
        1, "--top-k", "-k", help="Chunks to retrieve; the first comes from the store, the rest are prefilled live."
    ),
    no_cache: bool = typer.Option(
        False, "--no-cache", help="Full prefill of the same prompt (to compare with the cached path)."
    ),
    ape_scale: float = ApeScaleOption,
    doc: str | None = typer.Option(None, "--doc", help="Retrieve only from this document id."),
    json_out: bool = JsonOption,
    model: str | None = ModelOverrideOption,
    embedder: str | None = EmbedderOverrideOption,
    dtype: str | None = DtypeChoiceOption,
    kv_dtype: str | None = KvDtypeChoiceOption,
    device: str = DeviceOption,
    *,
    answering: dict,
    retrieval: dict,
):
    """Answer a question from the store: retrieve, load the chunk's KV, prefill only the question.

    Decoding is greedy (deterministic) with light repetition control; the cached answer and
    --no-cache decode alike, so in float32 they are token for token the same."""
    quiet_libraries()
    import ragkv

    if not question.strip():
        raise InputError("the question is empty; ask something")
    own = {"top_k": top_k, "use_cache": not no_cache, "ape_scale": ape_scale, "doc_ids": (doc,) if doc else None}
    settings = AskSettings.from_dict({**answering, **retrieval, **own})
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


@app.command()
@retrieval_options
def search(
    question: str | None = typer.Argument(None, help="The question (or give --file)."),
    store: str = StoreOption,
    top_k: int = typer.Option(5, "--top-k", "-k", help="Chunks to return."),
    doc: str | None = typer.Option(None, "--doc", help="Search only this document id."),
    questions_file: Path | None = typer.Option(
        None, "--file", help='JSONL of {"id", "question", "doc"?}: one JSON line of {"id", "results"} per question.'
    ),
    json_out: bool = JsonOption,
    device: str = DeviceOption,
    *,
    retrieval: dict,
):
    """Rank the store's chunks for a question, without generating: what `ask` would read.

    Each result has the document id, chunk index, chunk id, score and text (--json). With
    --file, many questions are searched in one process (evaluations, batch jobs)."""
    quiet_libraries()
    import ragkv
    from ragkv.engine.batch import Question, read_questions, search_all

    if (question is None) == (questions_file is None):
        raise InputError("give a question or --file questions.jsonl (one of the two)")
    if question is not None and not question.strip():
        raise InputError("the question is empty; ask something")
    settings = SearchSettings(top_k, **retrieval)  # checked before any model loads
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
    from ragkv.core.filters import check_fields
    from ragkv.store import open_snapshot

    with open_snapshot(store, require_documents=False) as snapshot:
        check_fields(settings.conditions, snapshot.catalog.documents.metadata_fields())


@app.command()
@answer_options
@retrieval_options
def batch(
    questions: Path = typer.Argument(
        ..., help='JSONL: one {"id", "question", "doc"?} per line ("doc" pins a document).'
    ),
    out: Path = typer.Option(..., "--out", "-o", help="Where to write one JSON answer (or error) per line."),
    store: str = StoreOption,
    top_k: int = typer.Option(1, "--top-k", "-k", help="Chunks per question."),
    max_batch: int = typer.Option(16, "--max-batch", help="Most questions decoded together."),
    device: str = DeviceOption,
    json_out: bool = JsonOption,
    quiet: bool = QuietOption,
    *,
    answering: dict,
    retrieval: dict,
):
    """Answer a file of questions, decoded together on the continuous batcher (as `ragkv serve`
    does): each answer equals `ragkv ask`'s, and is counted and logged like one."""
    quiet_libraries()
    import ragkv
    from ragkv.engine.batch import read_questions, run_batch
    from ragkv.pipelines.progress import default_reporter

    if max_batch < 1:
        raise InputError(f"--max-batch must be at least 1, got {max_batch}")
    settings = AskSettings.from_dict({**answering, **retrieval, "top_k": top_k})
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
@answer_options
def chat(
    store: str = StoreOption,
    top_k: int = typer.Option(
        1, "--top-k", "-k", help="Chunks the first message retrieves (kept for the conversation)."
    ),
    ape_scale: float = ApeScaleOption,
    model: str | None = ModelOverrideOption,
    device: str = DeviceOption,
    *,
    answering: dict,
):
    """An interactive conversation. The first message retrieves its context; every later turn
    reuses the cache of the whole conversation and prefills only the new message.

    Commands: /reset starts over (and retrieves again), /sources shows the context, /quit (or EOF) ends."""
    quiet_libraries()
    import ragkv

    settings = AskSettings.from_dict({**answering, "top_k": top_k, "ape_scale": ape_scale})
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
@serve_options
@vllm_front_options
def serve(
    store: str = StoreOption,
    model: str | None = ModelOverrideOption,
    device: str = DeviceOption,
    *,
    settings: ServeSettings,
    front: VllmFront | None,
):
    """Serve the store over HTTP: OpenAI-compatible /v1/chat/completions (streaming too),
    /v1/retrieve, /v1/models, /healthz, /metrics. Picks up re-indexed generations live."""
    quiet_libraries()
    import ragkv
    from ragkv.serve.service import serve as serve_engine

    announce = lambda line: typer.echo(line, err=True)  # noqa: E731
    if front is not None:
        from ragkv.serve.vllm_front import serve_on_vllm

        with ragkv.open(store, model=model, device="cpu", weights=False) as engine:
            serve_on_vllm(engine, store, settings, front.python, front.port, front.args, announce)
        return
    with ragkv.open(store, model=model, device=device, **settings.engine_options()) as engine:
        serve_engine(engine, store, settings, announce)


@app.command()
def calibrate(
    store: str = StoreOption,
    questions: int = typer.Option(32, "--questions", help="Held-in questions drawn from the store's own chunks."),
    top_k: int = typer.Option(5, "--top-k", "-k", help="Chunks each question retrieves (approximate modes need 2+)."),
    target: float = typer.Option(
        0.9, "--target", help="First-token agreement with a full prefill to reach (90% sure)."
    ),
    model: str | None = ModelOverrideOption,
    device: str = DeviceOption,
    json_out: bool = JsonOption,
    quiet: bool = QuietOption,
):
    """Measure the approximate modes against a full prefill on this store and record what
    `--mode approximate` runs as: the fastest mode and recompute share whose first-token
    agreement is at least --target at 90% confidence, or exact answers when none is (faster than exact)."""
    quiet_libraries()
    from ragkv.pipelines.calibrate import CalibrateSettings
    from ragkv.pipelines.calibrate import calibrate as run
    from ragkv.pipelines.progress import default_reporter

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
    from ragkv.core.config import parse_size
    from ragkv.store.kv.budget import budget_status, set_budget

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
    from ragkv.store import open_snapshot
    from ragkv.store.stats import store_stats

    with open_snapshot(store, require_documents=False) as snapshot:
        summary = store_stats(snapshot)
    _print(summary, json_out, text.stats_lines)


def _echo(lines: list[str], err: bool = False) -> None:
    for line in lines:
        typer.echo(line, err=err)


def _print(report: dict, json_out: bool, lines) -> None:
    """A report as one JSON object (--json), or as the `lines` (a ragkv.cli.output function) of it."""
    _echo([json.dumps(report)] if json_out else lines(report))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
