"""`ragkv serve --audit-log PATH`: one JSON line per answered request, off by default.

Each line: `time` (UTC, ISO 8601), `tenant` (the key's; "" without keys), `route`, `stores`,
`chunks` (each `[doc_id, chunk_id]` the answer used or the retrieval returned), `prompt_tokens`,
`completion_tokens`, `cached_tokens`. The file rotates when it passes `--audit-max-bytes`:
PATH.1 … PATH.5 keep the older lines (Python's RotatingFileHandler), so the log never grows
without bound. Nothing of a question or an answer's text is written.
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import threading
import time
from collections.abc import Iterable

from ragkv.serve.api_keys import Caller

BACKUPS = 5  # rotated files kept
TOTALS = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens")


class TenantTotals:
    """Requests and tokens per tenant since the server started, kept whether or not the audit log
    is on (the dashboard's tenants table; a key with filters never sees it)."""

    def __init__(self):
        self._totals: dict[str, dict[str, int]] = {}
        self._lock = threading.Lock()

    def add(self, tenant: str, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> None:
        with self._lock:
            totals = self._totals.setdefault(tenant, dict.fromkeys(TOTALS, 0))
            for name, value in zip(TOTALS, (1, prompt_tokens, completion_tokens, cached_tokens), strict=True):
                totals[name] += value

    def to_dict(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {tenant: dict(totals) for tenant, totals in self._totals.items()}


class NoAudit:
    """The audit log when it is off: only the tenants' totals are kept."""

    def __init__(self):
        self.totals = TenantTotals()

    def record(
        self,
        route: str,
        caller: Caller,
        stores: list[str],
        chunks: Iterable[tuple[str, int]],
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
        cached_tokens: int = 0,
    ) -> None:
        self.totals.add(caller.tenant, prompt_tokens, completion_tokens, cached_tokens)

    def close(self) -> None:
        pass


class AuditLog(NoAudit):
    def __init__(self, path: str, max_bytes: int):
        super().__init__()
        handler = logging.handlers.RotatingFileHandler(path, maxBytes=max_bytes, backupCount=BACKUPS, encoding="utf-8")
        handler.setFormatter(logging.Formatter("%(message)s"))
        self._log = logging.getLogger(f"ragkv.audit.{path}")
        self._log.propagate = False
        self._log.setLevel(logging.INFO)
        self._log.handlers = [handler]

    def record(
        self,
        route: str,
        caller: Caller,
        stores: list[str],
        chunks: Iterable[tuple[str, int]],
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
        cached_tokens: int = 0,
    ) -> None:
        super().record(route, caller, stores, chunks, prompt_tokens, completion_tokens, cached_tokens)
        line = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "tenant": caller.tenant,
            "route": route,
            "stores": stores,
            "chunks": [[doc_id, chunk_id] for doc_id, chunk_id in chunks],
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "cached_tokens": cached_tokens,
        }
        self._log.info(json.dumps(line))

    def close(self) -> None:
        for handler in self._log.handlers:
            handler.close()
        self._log.handlers = []


def open_audit(path: str | None, max_bytes: int) -> AuditLog | NoAudit:
    return AuditLog(path, max_bytes) if path else NoAudit()
