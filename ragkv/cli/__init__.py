"""The `ragkv` command: its commands (`commands`: the store's; `answering`: the ones that answer;
`serving`: serve and key; `evaluating`: eval),
options, output and the way it runs. Installed, the command is `ragkv.cli:main`; `python -m ragkv`
and a checkout's `python cli.py` run the same."""

from ragkv.cli import answering, evaluating, serving  # noqa: F401 - register their commands on the app
from ragkv.cli.commands import app, main

__all__ = ["app", "main"]
