"""The `ragkv` command, run from a checkout: `python cli.py ingest data/ ...`. The commands live in
`ragkv.cli`; installed, the same command is `ragkv` or `python -m ragkv`."""

from ragkv.cli import app, main

__all__ = ["app", "main"]

if __name__ == "__main__":
    main()
