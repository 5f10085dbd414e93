"""`ragkv serve`'s options: the service's settings (`serve_options`, building `ServeSettings`)
and the engine in front of which it serves (`vllm_front_options`, building a `VllmFront`)."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import typer

from ragkv.cli.app import OptionGroup
from ragkv.cli.options import VllmPythonOption
from ragkv.core.config import BatchSettings, parse_size
from ragkv.core.errors import InputError

BATCH = BatchSettings()  # each knob's one default, the engine's
BATCH_KNOBS = ("max_queue", "max_batch", "max_batch_tokens", "prefill_chunk")


def _serve_settings(**values):
    from ragkv.serve.api import ServeSettings

    batch = BatchSettings(**{name: values.pop(name) for name in BATCH_KNOBS})
    return ServeSettings(
        **{
            **values,
            "batch": batch,
            "api_key": values["api_key"] or None,
            "pending_bytes": parse_size(values["pending_bytes"], "--pending-bytes"),
            "audit_max_bytes": parse_size(values["audit_max_bytes"], "--audit-max-bytes"),
            "rerankers": tuple(values["rerankers"] or ()),
        }
    )


serve_options = OptionGroup(
    "settings",
    (
        ("host", str, typer.Option("127.0.0.1", "--host", help="Address to bind (loopback unless you say otherwise).")),
        ("port", int, typer.Option(8000, "--port", help="TCP port.")),
        (
            "api_key",
            str | None,
            typer.Option(
                None, "--api-key", envvar="RAGKV_API_KEY", help="Require Authorization: Bearer KEY (env RAGKV_API_KEY)."
            ),
        ),
        (
            "keys_file",
            str | None,
            typer.Option(
                None,
                "--keys",
                envvar="RAGKV_KEYS",
                help="API keys with scopes, a TOML file: each key's tenant, stores, filters (ANDed with every "
                "retrieval it makes), max_tokens and requests_per_minute; `ragkv key` makes one. Re-read on "
                "SIGHUP. See docs/tenants.md.",
            ),
        ),
        (
            "audit_log",
            str | None,
            typer.Option(
                None,
                "--audit-log",
                help="Write one JSON line per answered request (time, tenant, route, stores, chunks used, "
                "tokens; never the text) to this file. Off by default.",
            ),
        ),
        (
            "audit_max_bytes",
            str,
            typer.Option(
                "100MiB", "--audit-max-bytes", help="The audit log rotates past this size (PATH.1 ... PATH.5 kept)."
            ),
        ),
        (
            "isolate_tenants",
            bool,
            typer.Option(
                False,
                "--isolate-tenants",
                help="Key the RAM tier of stored KV by tenant too, and store no KV computed on a miss: no tenant "
                "can time what another read. Costs a read (or a prefill) per tenant. See docs/tenants.md.",
            ),
        ),
        (
            "rerankers",
            list[str] | None,
            typer.Option(
                None,
                "--reranker",
                help="A cross-encoder requests may name in ragkv.reranker (repeat for several): a sentence-"
                "transformers CrossEncoder folder or hub id, loaded on first use. Requests can name no other.",
            ),
        ),
        (
            "max_queue",
            int,
            typer.Option(
                BATCH.max_queue, "--max-queue", help="Requests that may wait to join the batch; more get 503."
            ),
        ),
        (
            "max_batch",
            int,
            typer.Option(
                BATCH.max_batch,
                "--max-batch",
                help="Requests decoded together (continuous batching: each "
                "forward advances every running answer by one token).",
            ),
        ),
        (
            "max_batch_tokens",
            int,
            typer.Option(
                BATCH.max_batch_tokens,
                "--max-batch-tokens",
                help="KV tokens the running batch may hold (rows x the longest prompt + "
                "answer); requests beyond it wait. Bounds memory.",
            ),
        ),
        (
            "prefill_chunk",
            int,
            typer.Option(
                BATCH.prefill_chunk,
                "--prefill-chunk",
                help="Prompt tokens a request prefills per step, so a long prefill never stalls running streams.",
            ),
        ),
        ("max_tokens_cap", int, typer.Option(1024, "--max-tokens-cap", help="Largest max_tokens a request gets.")),
        (
            "write_back",
            bool,
            typer.Option(
                True,
                "--write-back/--no-write-back",
                help="Store the KV computed for a retrieved chunk the store lacks (in the "
                "background, within the KV budget), so the next question that uses it "
                "loads it. --no-write-back leaves the store as it is.",
            ),
        ),
        (
            "pending_bytes",
            str,
            typer.Option(
                "1GiB",
                "--pending-bytes",
                help="On an S3 store, which replicas read but never write: the most computed KV this "
                "replica leaves pending for the writer's fold (its oldest goes first).",
            ),
        ),
        (
            "leave_pending",
            bool,
            typer.Option(
                False,
                "--leave-pending",
                help="On a folder store shared by replicas on several machines: leave computed KV "
                "pending for the --writer replica's fold, as on S3, instead of taking the store's lock.",
            ),
        ),
        (
            "writer",
            bool,
            typer.Option(
                False,
                "--writer/--no-writer",
                help="This replica is the store's one writer: every --fold-every seconds it folds what "
                "the replicas left pending (computed KV, hit logs) into a new generation, which each "
                "picks up on its next request. Start one per store (or run `ragkv fold` from cron).",
            ),
        ),
        ("fold_every_s", float, typer.Option(60.0, "--fold-every", help="--writer: seconds between folds.")),
    ),
    _serve_settings,
)


@dataclass(frozen=True)
class VllmFront:
    """`serve --engine vllm`: the python that has vLLM, the port it listens on, more arguments."""

    python: str
    port: int
    args: str


def _vllm_front(engine_name: str, vllm_python: str | None, vllm_port: int, vllm_args: str | None) -> VllmFront | None:
    if engine_name == "ragkv":
        return None
    if engine_name != "vllm":
        raise InputError(f"unknown --engine {engine_name!r}; use ragkv or vllm")
    return VllmFront(vllm_python or sys.executable, vllm_port, vllm_args or "")


vllm_front_options = OptionGroup(
    "front",
    (
        (
            "engine_name",
            str,
            typer.Option(
                "ragkv",
                "--engine",
                help="ragkv (this process runs the model) or vllm (a vLLM server runs it, loading the store's KV "
                "through the ragkv connector; ragkv retrieves and lays out the prompt in front, with the same API).",
            ),
        ),
        ("vllm_python", str | None, VllmPythonOption),
        (
            "vllm_port",
            int,
            typer.Option(8100, "--vllm-port", help="--engine vllm: the port vLLM listens on (loopback)."),
        ),
        (
            "vllm_args",
            str | None,
            typer.Option(
                None,
                "--vllm-args",
                help="--engine vllm: more arguments for vLLM's server, e.g. \"--max-model-len 4096 "
                '--gpu-memory-utilization 0.8".',
            ),
        ),
    ),
    _vllm_front,
)
