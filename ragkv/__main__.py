"""`python -m ragkv ...`: the `ragkv` command."""

from ragkv.cli import main

main()
