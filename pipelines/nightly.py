"""The nightly re-index job: make the store match the corpus, reclaim space, check integrity.

    ragkv reindex DOCS... --store DIR [--report report.json] [--json]     (cron)
    run_nightly(["docs/"], "./kvstore").to_dict()                         (an Airflow task)

Steps: an incremental ingest that also removes documents no longer in DOCS (unchanged ones
cost nothing), `gc`, then `verify`. Exit code 0 when every step succeeded and the store
verifies; otherwise the failing step's code (2 bad input, 4 integrity problems, 5 store
locked, 6 model, 7 store not writable). The JSON report holds every step's numbers.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ragkv.core.config import IngestSettings, ModelSettings
from ragkv.pipelines.ingest import ingest
from ragkv.pipelines.progress import Reporter
from ragkv.store import collect_garbage, open_snapshot, verify

EXIT_PROBLEMS = 4


@dataclass
class NightlyReport:
    ingest: dict = field(default_factory=dict)
    gc: dict | None = None
    verify: dict | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.verify is None or self.verify["ok"]

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else EXIT_PROBLEMS

    def to_dict(self) -> dict:
        return {
            "ok": self.ok,
            "ingest": self.ingest,
            "gc": self.gc,
            "verify": self.verify,
            "seconds": round(self.seconds, 3),
        }


def run_nightly(
    paths: Sequence[Path | str],
    store: Path | str,
    model: ModelSettings | None = None,
    settings: IngestSettings | None = None,
    gc: bool = True,
    check: bool = True,
    wait: bool = False,
    reporter: Reporter | None = None,
    engine: str = "ragkv",
    workers: int = 0,
) -> NightlyReport:
    started = time.perf_counter()
    report = NightlyReport()
    report.ingest = ingest(
        paths,
        store,
        model=model,
        settings=settings,
        reporter=reporter,
        wait=wait,
        prune=True,
        engine=engine,
        workers=workers,
    ).to_dict()
    if gc:
        report.gc = collect_garbage(store, wait=wait).to_dict()
    if check:
        with open_snapshot(store, require_documents=False) as snapshot:
            report.verify = verify(snapshot).to_dict()
    report.seconds = time.perf_counter() - started
    return report
