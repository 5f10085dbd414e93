"""MkDocs hook: the CLI reference page is generated from the typer app, so it can never drift
from `--help` (each command's help stays the reference for its options)."""

from __future__ import annotations

import re

MARKER = "<!-- ragkv-cli-reference -->"


def cli_reference() -> str:
    import typer
    import typer.cli

    from ragkv.cli import app

    command = typer.main.get_command(app)
    text = typer.cli.get_docs_for_click(obj=command, ctx=typer.models.Context(command), name="ragkv", title="ragkv")
    return re.sub(r"^(#+) ", r"#\1 ", text, flags=re.M)  # one level down: the page has its own title


def on_page_markdown(markdown: str, page, config, files) -> str:
    return markdown.replace(MARKER, cli_reference()) if MARKER in markdown else markdown
