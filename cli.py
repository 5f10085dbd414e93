"""The `ragkv` command: a thin layer over the library. Each command parses its options,
calls one library function and prints the result; errors become one line and an exit code
in one place (`_Group.invoke`)."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import List, Optional

import typer
from typer.core import TyperGroup

from ragkv.config import DEFAULT_EMBEDDER, DEFAULT_MODEL, DEFAULT_STORE, DEFAULT_SYSTEM_PROMPT, DTYPES
from ragkv.errors import RagkvError


class _Group(TyperGroup):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except RagkvError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(exc.exit_code) from None


app = typer.Typer(
    cls=_Group,
    help="Compute each document's KV cache once; answer questions by prefilling only the question.\n\n"
         "  ragkv ingest data/ --store ./kvstore\n\n"
         "  ragkv ask \"How do I rotate the API key?\" --store ./kvstore",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

StoreOption = typer.Option(Path(DEFAULT_STORE), "--store", "-s", envvar="RAGKV_STORE",
                           help="Store directory (env RAGKV_STORE).")
JsonOption = typer.Option(False, "--json", help="Print one JSON object instead of text (for scripts).")
DeviceOption = typer.Option("auto", "--device", help="auto (CUDA when available), cpu or cuda.")


def _quiet_libraries() -> None:
    """Our own messages (e.g. the one-time model conversion) to stderr; library chatter off."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("ragkv")
    if not logger.handlers:
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


@app.command()
def ingest(
    paths: List[Path] = typer.Argument(..., help="Files or directories: .txt .md .rst .html .jsonl."),
    store: Path = StoreOption,
    model: str = typer.Option(DEFAULT_MODEL, "--model", "-m",
                              help="LLM: a local Hugging Face folder, a hub id, or 'smollm2' (bundled)."),
    embedder: str = typer.Option(DEFAULT_EMBEDDER, "--embedder",
                                 help="sentence-transformers folder or hub id (default: bundled all-MiniLM-L6-v2)."),
    dtype: str = typer.Option("auto", "--dtype",
                              help=f"KV dtype, part of the cache key: auto (float32 on CPU, bfloat16 on CUDA), {', '.join(DTYPES)}."),
    device: str = DeviceOption,
    chunk_tokens: int = typer.Option(512, "--chunk-tokens", help="Most LLM tokens per chunk."),
    system_prompt: str = typer.Option(DEFAULT_SYSTEM_PROMPT, "--system-prompt",
                                      help="System prompt, computed once and part of every cache key."),
    batch_tokens: int = typer.Option(0, "--batch-tokens", help="Padded tokens per forward (0: 2048 on CPU, 16384 on CUDA)."),
    wait: bool = typer.Option(False, "--wait", help="If another ingest holds the store, wait for it instead of failing."),
    json_out: bool = JsonOption,
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bars."),
):
    """Read, chunk, embed documents and store each chunk's KV cache. Re-running skips what is stored."""
    _quiet_libraries()
    import ragkv
    from pipelines.progress import default_reporter
    from ragkv.config import IngestSettings, ModelSettings

    report = ragkv.ingest(
        paths, store,
        model=ModelSettings(model=model, embedder=embedder, device=device, dtype=dtype),
        settings=IngestSettings(chunk_tokens=chunk_tokens, system_prompt=system_prompt, batch_tokens=batch_tokens),
        reporter=default_reporter(quiet or json_out),
        wait=wait,
    )
    if json_out:
        typer.echo(json.dumps(report.to_dict()))
        return
    docs = report.documents
    typer.echo(f"Store {report.store} (generation {report.generation}): "
               f"{docs['added']} added, {docs['changed']} changed, {docs['unchanged']} unchanged documents")
    typer.echo(f"KV: {report.kv_computed} chunks computed ({report.tokens_computed:,} tokens, "
               f"{report.tokens_per_s:,.0f} tokens/s), {report.kv_reused} already stored "
               f"({report.tokens_skipped:,} tokens skipped); {report.model} {report.dtype} on {report.device}; "
               f"{report.total_s:.1f} s")
    if report.skipped:
        typer.echo(f"Skipped {len(report.skipped)} file(s):")
        for item in report.skipped:
            typer.echo(f"  {item.source}: {item.reason}")


@app.command()
def ask(
    question: str = typer.Argument(..., help="The question."),
    store: Path = StoreOption,
    top_k: int = typer.Option(1, "--top-k", "-k", help="Chunks to retrieve; the first comes from the store, the rest are prefilled live."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", help="Most tokens to generate."),
    no_cache: bool = typer.Option(False, "--no-cache", help="Full prefill of the same prompt (to compare with the cached path)."),
    json_out: bool = JsonOption,
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Override the model the store was built with."),
    embedder: Optional[str] = typer.Option(None, "--embedder", help="Override the embedder the store was built with."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="Which of the store's dtypes to use (default: the last ingested)."),
    device: str = DeviceOption,
):
    """Answer a question from the store: retrieve, load the chunk's KV, prefill only the question."""
    _quiet_libraries()
    import ragkv

    with ragkv.open(store, model=model, embedder=embedder, device=device, dtype=dtype) as engine:
        stream = engine.stream(question, top_k=top_k, max_new_tokens=max_new_tokens, use_cache=not no_cache)
        for delta in stream:
            if not json_out:
                sys.stdout.write(delta)
                sys.stdout.flush()
        answer = stream.answer
    if json_out:
        typer.echo(json.dumps(answer.to_dict()))
        return
    typer.echo("")
    _print_answer_footer(answer)


def _print_answer_footer(answer) -> None:
    err = lambda text: typer.echo(text, err=True)  # noqa: E731
    for s in answer.sources:
        err(f"source: {s.source} (chunk {s.chunk_index}, score {s.score:.3f})")
    st = answer.stats
    rate = st.generated_tokens / st.decode_s if st.decode_s else 0.0
    err(f"{st.mode}: {st.reused_tokens} tokens reused, {st.computed_tokens} computed, {st.generated_tokens} generated | "
        f"retrieval {st.retrieval_ms:.0f} ms, KV load {st.kv_load_ms:.0f} ms, prefill {st.prefill_ms:.0f} ms, "
        f"TTFT {st.ttft_s:.2f} s, total {st.total_s:.2f} s ({rate:.1f} tokens/s)")
    for warning in st.warnings:
        err(f"warning: {warning}")


@app.command()
def info(store: Path = StoreOption, json_out: bool = JsonOption):
    """What a store holds: documents, chunks, KV entries and bytes, models and dtypes."""
    from store import open_snapshot

    with open_snapshot(store, require_documents=False) as snap:
        counts = snap.catalog.counts()
        summary = {
            "store": str(store),
            "generation": snap.generation,
            **counts,
            "vectors": len(snap.vectors),
            "kv_bytes": snap.catalog.kv_bytes(),
            "embedder": snap.catalog.meta().get("embedder"),
            "profiles": [{"model": p["model_name"], "dtype": p["dtype"], "profile_id": p["profile_id"][:16]}
                         for p in snap.catalog.profiles()],
        }
    if json_out:
        typer.echo(json.dumps(summary))
        return
    typer.echo(f"{summary['store']} generation {summary['generation']}: {counts['documents']} documents, "
               f"{counts['chunks']} chunks, {counts['kv_entries']} KV entries ({summary['kv_bytes'] / 2**20:.1f} MiB)")
    typer.echo(f"embedder: {summary['embedder']}")
    for p in summary["profiles"]:
        typer.echo(f"model: {p['model']} ({p['dtype']}), profile {p['profile_id']}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
