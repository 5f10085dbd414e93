"""Progress reporting for long pipeline stages: a rich progress bar on a terminal, nothing
otherwise. Pipelines call `stage(...)` and `advance(...)`; they never print."""

from __future__ import annotations

import sys
import time


class Reporter:
    """Does nothing; the interface pipelines report through."""

    def stage(self, name: str, total: int, unit: str = "chunks") -> None:
        pass

    def advance(self, count: int = 1, tokens: int = 0) -> None:
        pass

    def done(self) -> None:
        pass


class RichReporter(Reporter):
    """A rich progress bar on stderr per stage: count, tokens/s, elapsed and remaining time."""

    def __init__(self):
        from rich.console import Console
        from rich.progress import (
            BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn,
        )

        self._progress = Progress(
            TextColumn("{task.description:<12}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[unit]}"),
            TextColumn("{task.fields[rate]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            transient=False,
        )
        self._task = None
        self._tokens = 0
        self._started = 0.0
        self._progress.start()

    def stage(self, name: str, total: int, unit: str = "chunks") -> None:
        self._tokens, self._started = 0, time.perf_counter()
        self._task = self._progress.add_task(name, total=total, unit=unit, rate="")

    def advance(self, count: int = 1, tokens: int = 0) -> None:
        self._tokens += tokens
        elapsed = max(time.perf_counter() - self._started, 1e-9)
        rate = f"{self._tokens / elapsed:,.0f} tok/s" if self._tokens else ""
        self._progress.update(self._task, advance=count, rate=rate)

    def done(self) -> None:
        self._progress.stop()


def default_reporter(quiet: bool = False) -> Reporter:
    """A progress bar when stderr is a terminal and not `quiet`; silence otherwise."""
    return RichReporter() if not quiet and sys.stderr.isatty() else Reporter()
