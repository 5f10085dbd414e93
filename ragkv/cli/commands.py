"""The `ragkv` command: a thin layer over the library. Each command parses its options,
calls one library function and prints the result; errors become one line and an exit code
in one place (`ragkv.cli.app.CommandGroup`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import typer

import ragkv.cli.output as text
from ragkv.cli.app import new_app, quiet_libraries
from ragkv.cli.options import (
    DeviceOption,
    JsonOption,
    ModelOverrideOption,
    PathsArgument,
    QuietOption,
    StoreOption,
    WaitOption,
    ingest_options,
    runner_options,
)

if TYPE_CHECKING:
    pass


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
    print_report(report.to_dict(), json_out, text.ingest_lines)


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
        echo_lines(text.ingest_lines(report.ingest))
        echo_lines(text.gc_lines(report.gc) if report.gc else [])
        echo_lines(text.verify_lines(report.verify) if report.verify else [])
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

    print_report(collect_garbage(store, other_models=other_models, wait=wait).to_dict(), json_out, text.gc_lines)


@app.command()
def fold(store: str = StoreOption, wait: bool = WaitOption, json_out: bool = JsonOption):
    """Fold what readers left pending (S3: KV computed on misses) into the store; ingest and reindex fold too."""
    from ragkv.store.kv.writeback import fold as fold_store

    print_report(fold_store(store, wait=wait).to_dict(), json_out, text.fold_lines)


@app.command()
def verify(
    store: str = StoreOption,
    repair: bool = typer.Option(False, "--repair", help="Recompute bad entries with the model that made them."),
    device: str = DeviceOption,
    json_out: bool = JsonOption,
):
    """Check every KV entry's checksum, every chunk's link, and the vector index. Exit 4 on problems."""
    from ragkv.model.device import resolve_device
    from ragkv.store import open_snapshot
    from ragkv.store import verify as verify_store

    fixed = None
    if repair:
        quiet_libraries()
        from ragkv.pipelines.repair import repair as repair_store

        fixed = repair_store(store, device=resolve_device(device))
        echo_lines([] if json_out else text.repair_lines(fixed))
    with open_snapshot(store, require_documents=False, lenient=True) as snapshot:
        report = {**verify_store(snapshot).to_dict(), **({"repair": fixed.to_dict()} if fixed else {})}
    print_report(report, json_out, text.verify_lines)
    raise typer.Exit(0 if report["ok"] else 4)


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
    echo_lines(text.calibrate_lines(result, store))


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
    print_report(report.to_dict(), json_out, text.budget_lines)


@app.command()
def stats(store: str = StoreOption, json_out: bool = JsonOption):
    """What a store holds: documents, chunks, tokens and bytes per model and dtype, shards, dead bytes."""
    from ragkv.store import open_snapshot
    from ragkv.store.stats import store_stats

    with open_snapshot(store, require_documents=False) as snapshot:
        summary = store_stats(snapshot)
    print_report(summary, json_out, text.stats_lines)


def echo_lines(lines: list[str], err: bool = False) -> None:
    for line in lines:
        typer.echo(line, err=err)


def print_report(report: dict, json_out: bool, lines) -> None:
    """A report as one JSON object (--json), or as the `lines` (a ragkv.cli.output function) of it."""
    echo_lines([json.dumps(report)] if json_out else lines(report))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
