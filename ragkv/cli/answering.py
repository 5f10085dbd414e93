"""The commands that answer: `ask`, `search`, `batch`, `chat` and `serve` (registered on the one
`ragkv` app of ragkv.cli.commands)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

import ragkv.cli.output as text
from ragkv.cli.app import quiet_libraries
from ragkv.cli.commands import app, echo_lines
from ragkv.cli.options import (
    ApeScaleOption,
    DeviceOption,
    DtypeChoiceOption,
    EmbedderOverrideOption,
    JsonOption,
    KvDtypeChoiceOption,
    ModelOverrideOption,
    QuietOption,
    StoreOption,
    answer_options,
    retrieval_options,
)
from ragkv.core.config import AskSettings, SearchSettings
from ragkv.core.errors import InputError


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
    echo_lines(text.answer_footer(answer), err=True)


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
                echo_lines(text.search_lines(found["results"]))
                echo_lines([f"warning: {warning}" for warning in found.get("warnings", [])], err=True)


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
    echo_lines(text.batch_lines(summary, out))
    echo_lines([f"  {error}" for error in summary["errors"]], err=True)


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
                echo_lines([text.source_line(s) for s in conversation.sources], err=True)
                continue
            if not message:
                continue
            stream = conversation.stream(message)
            for delta in stream:
                sys.stdout.write(delta)
                sys.stdout.flush()
            typer.echo("")
            echo_lines(text.answer_footer(stream.answer, sources=len(conversation.turns) == 1), err=True)
