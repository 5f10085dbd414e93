"""Progress reporting for long pipeline stages: a rich progress bar on a terminal, and a plain
line per tenth of each stage when stderr is a file or a pipe (a nightly job's log shows where
a long ingest is). Pipelines call `stage(...)` and `advance(...)`; they never print."""

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
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
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


class LineReporter(Reporter):
    """One line on stderr as each stage starts, at each tenth of it, and as it ends."""

    def __init__(self, stream=None):
        self._stream = stream
        self._name, self._unit, self._total, self._done, self._tenths = "", "", 0, 0, 0
        self._tokens, self._started = 0, 0.0

    def stage(self, name: str, total: int, unit: str = "chunks") -> None:
        self._end_stage()
        self._name, self._unit, self._total, self._done, self._tenths = name, unit, total, 0, 0
        self._tokens, self._started = 0, time.perf_counter()
        self._say(f"{name}: {total:,} {unit}")

    def advance(self, count: int = 1, tokens: int = 0) -> None:
        self._done, self._tokens = self._done + count, self._tokens + tokens
        tenths = 10 * self._done // self._total if self._total else 0
        if self._tenths < tenths < 10:
            self._tenths = tenths
            self._say(f"{self._name}: {self._done:,}/{self._total:,} {self._unit}{self._rate()}")

    def done(self) -> None:
        self._end_stage()

    def _end_stage(self) -> None:
        if self._name:
            seconds = time.perf_counter() - self._started
            self._say(f"{self._name}: {self._done:,}/{self._total:,} {self._unit} in {seconds:.1f} s{self._rate()}")
            self._name = ""

    def _rate(self) -> str:
        elapsed = time.perf_counter() - self._started
        return f" ({self._tokens / elapsed:,.0f} tokens/s)" if self._tokens and elapsed > 0 else ""

    def _say(self, text: str) -> None:
        stream = self._stream or sys.stderr  # whatever stderr is now (test runners swap it)
        stream.write(f"ragkv: {text}\n")
        stream.flush()


def default_reporter(quiet: bool = False) -> Reporter:
    """A progress bar when stderr is a terminal, plain lines when it is not; silence when `quiet`."""
    if quiet:
        return Reporter()
    return RichReporter() if sys.stderr.isatty() else LineReporter()
