"""How the `ragkv` command runs (cli.py's commands are its content): every failure one
`error: ...` line and an exit code, our log lines on stderr, the libraries' chatter off, and
options several commands share handed to each as one value (OptionGroup)."""

from __future__ import annotations

import functools
import inspect
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import typer
from typer.core import TyperGroup

try:  # typer 0.2x carries its own copy of click, whose exceptions its parser raises
    from typer._click.exceptions import ClickException, UsageError
except ImportError:  # older typer runs on click itself
    from click.exceptions import ClickException, UsageError  # type: ignore[assignment]

from ragkv.core.errors import RagkvError


class _StderrHandler(logging.Handler):
    """Our own messages (the one-time model conversion, waiting for a lock, warnings) to
    whatever stderr is now (test runners swap it)."""

    def emit(self, record):
        sys.stderr.write(self.format(record) + "\n")


def log_to_stderr() -> None:
    logger = logging.getLogger("ragkv")
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        logger.addHandler(_StderrHandler())
    logger.setLevel(logging.INFO)
    logger.propagate = False


class CommandGroup(TyperGroup):
    """Every failure ends here as one `error: ...` line and an exit code (see ragkv.core.errors):
    ragkv's own errors, option parsing errors (2), and, as a last resort, anything else, named
    as the bug it is (1; RAGKV_TRACEBACK=1 shows where)."""

    def invoke(self, ctx):
        log_to_stderr()
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


def quiet_libraries() -> None:
    """Library chatter (transformers' warnings and progress bars) off."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


@dataclass(frozen=True)
class OptionGroup:
    """Options several commands share, as one decorator: typer sees each of `options` (name,
    type, typer.Option) in the command's signature, in place of the command's parameter
    `name`; the command gets `build(**their values)` as `name`."""

    name: str
    options: tuple[tuple[str, Any, Any], ...]
    build: Callable[..., Any]

    def __call__(self, command: Callable) -> Callable:
        signature = inspect.signature(command)
        names = [option for option, _, _ in self.options]

        @functools.wraps(command)
        def run(*args, **kwargs):
            values = {option: kwargs.pop(option) for option in names}
            return command(*args, **kwargs, **{self.name: self.build(**values)})

        # typer reads the types: the command's options, their types written as strings
        # (postponed annotations), are evaluated where the command was written, as
        # inspect.signature(eval_str=True) would. Parameters without a default are groups'
        # values, left as written (their types may be imported only where the command runs).
        def evaluated(p: inspect.Parameter) -> inspect.Parameter:
            written = p.annotation
            if not isinstance(written, str) or p.default is inspect.Parameter.empty:
                return p
            return p.replace(annotation=eval(written, command.__globals__))

        kept = [evaluated(p) for p in signature.parameters.values() if p.name != self.name]
        added = [
            inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=o, annotation=t) for n, t, o in self.options
        ]
        run.__signature__ = signature.replace(parameters=[*kept, *added])  # type: ignore[attr-defined]
        run.__annotations__ = {p.name: p.annotation for p in [*kept, *added]}
        return run


def new_app(help_text: str) -> typer.Typer:
    """The `ragkv` command's typer app: errors as CommandGroup says, --version, no rich markup."""
    app = typer.Typer(
        cls=CommandGroup,
        help=help_text,
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
        rich_markup_mode=None,
    )

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

    return app


def _show_version(value: bool) -> None:
    if value:
        from ragkv import __version__
        from ragkv.core.formats import STORE_FORMAT

        typer.echo(f"ragkv {__version__} (store format {STORE_FORMAT})")
        raise typer.Exit()
