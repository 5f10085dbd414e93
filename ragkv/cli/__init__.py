"""The `ragkv` command: its commands (`commands`), options, output and the way it runs. Installed,
the command is `ragkv.cli:main`; `python -m ragkv` and a checkout's `python cli.py` run the same."""

from ragkv.cli.commands import app, main

__all__ = ["app", "main"]
