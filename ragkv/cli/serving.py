"""The commands that run the service: `serve`, and `key` (a new API key for `serve --keys`)."""

from __future__ import annotations

import json
from contextlib import ExitStack
from typing import TYPE_CHECKING

import typer

from ragkv.cli.app import quiet_libraries
from ragkv.cli.commands import app
from ragkv.cli.options import DeviceOption, ModelOverrideOption
from ragkv.cli.serve import serve_options, vllm_front_options
from ragkv.core.config import DEFAULT_STORE
from ragkv.core.errors import InputError

if TYPE_CHECKING:
    from ragkv.cli.serve import VllmFront
    from ragkv.serve.api import ServeSettings

StoresOption = typer.Option(
    None,
    "--store",
    "-s",
    envvar="RAGKV_STORE",
    help="The store to serve: a directory or s3://BUCKET/PREFIX (env RAGKV_STORE; default ./kvstore). Repeat "
    "as --store NAME=PATH to serve several by name on one loaded model: a request's `model` picks one, and "
    "/v1/models lists those its key may use. A keys file's [stores] adds more.",
)


@app.command()
@serve_options
@vllm_front_options
def serve(
    stores: list[str] | None = StoresOption,
    model: str | None = ModelOverrideOption,
    device: str = DeviceOption,
    *,
    settings: ServeSettings,
    front: VllmFront | None,
):
    """Serve the store over HTTP: OpenAI-compatible /v1/chat/completions (streaming too),
    /v1/retrieve, /v1/models, /healthz, /metrics. Picks up re-indexed generations live.
    With --keys, each API key reads only its own stores and documents (docs/tenants.md)."""
    quiet_libraries()
    import ragkv
    from ragkv.serve.api_keys import parse_store_options, read_keys
    from ragkv.serve.service import serve as serve_engine

    named = parse_store_options(stores or [DEFAULT_STORE])
    if settings.keys_file:
        for name, path in read_keys(settings.keys_file).stores.items():
            if name in named:
                raise InputError(f"store {name!r} is named both by --store and in {settings.keys_file}")
            named[name] = path
    where = ", ".join(f"{n}={p}" for n, p in named.items()) if len(named) > 1 else next(iter(named.values()))
    announce = lambda line: typer.echo(line, err=True)  # noqa: E731
    if front is not None:
        from ragkv.serve.vllm_front import serve_on_vllm

        if len(named) > 1:
            raise InputError("--engine vllm serves one store (its connector loads from one); give one --store")
        store = next(iter(named.values()))
        with ragkv.open(store, model=model, device="cpu", weights=False) as engine:
            serve_on_vllm(engine, store, settings, front.python, front.port, front.args, announce)
        return
    with ExitStack() as opened:
        engines: dict = {}
        for name, path in named.items():
            first = next(iter(engines.values()), None)
            options = {**settings.engine_options(), "share": first}
            engines[name] = opened.enter_context(ragkv.open(path, model=model, device=device, **options))
        serve_engine(
            engines if len(engines) > 1 or "ragkv" not in engines else engines["ragkv"], where, settings, announce
        )


@app.command()
def key(
    tenant: str = typer.Option(..., "--tenant", help="Whose key: names it in the audit log and keys its caches."),
    stores: list[str] | None = typer.Option(None, "--store", help="A store it may use (repeat; default all)."),
    filters: list[str] | None = typer.Option(
        None, "--filter", help="ANDed with every retrieval it makes (repeat), e.g. 'team=hr or path=handbook/*'."
    ),
    max_tokens: int | None = typer.Option(None, "--max-tokens", help="Its answers' token cap."),
    requests_per_minute: float | None = typer.Option(None, "--requests-per-minute", help="Its rate (429 beyond)."),
    as_json: bool = typer.Option(False, "--json", help="Print {key, entry} as JSON."),
):
    """Make a new API key for `ragkv serve --keys FILE`: prints the [[keys]] entry to add to the
    file (it holds only the key's hash: `ragkv key --tenant hr >> keys.toml`) and, on stderr, the
    key itself (give it to its holder; it is not kept). Then SIGHUP the server to take it up."""
    from ragkv.core.scope import Scope
    from ragkv.serve.api_keys import check_store_name, key_digest, new_key, parse_keys

    for name in stores or ():
        check_store_name(name)
    Scope(tenant, tuple(filters or ()))  # checks the tenant and the filters now
    secret = new_key()
    entry: dict = {"tenant": tenant, "sha256": key_digest(secret).hex()}
    if stores:
        entry["stores"] = list(stores)
    if filters:
        entry["filters"] = list(filters)
    if max_tokens is not None:
        entry["max_tokens"] = max_tokens
    if requests_per_minute is not None:
        entry["requests_per_minute"] = requests_per_minute
    parse_keys({"keys": [entry]})  # what the server will accept
    if as_json:
        typer.echo(json.dumps({"key": secret, "entry": entry}))
        return
    lines = ["", "[[keys]]", *(f"{name} = {json.dumps(value)}" for name, value in entry.items())]
    typer.echo("\n".join(lines))
    typer.echo(f"key for tenant {tenant} (give it to its holder; it is not kept): {secret}", err=True)
