"""`ragkv serve --keys FILE`: API keys, each with its tenant, stores and scope.

The file is TOML (`ragkv key --tenant NAME` prints a new key and its entry):

    [stores]                        # optional: served stores by name, as --store NAME=PATH does
    handbook = "/srv/ragkv/handbook"

    [[keys]]
    tenant = "hr"                   # whose caches (ragkv.core.scope); names the key in the audit log
    sha256 = "9f86d0..."            # sha256 of the key, hex: the file never holds a key itself
    stores = ["handbook"]           # the stores it may use (default: all served)
    filters = ["team=hr or path=handbook/*"]   # ANDed with every retrieval it makes
    max_tokens = 256                # optional: its answers' cap (below --max-tokens-cap)
    requests_per_minute = 120       # optional: beyond it, 429 with Retry-After

A sent key is hashed and compared with every entry's hash in constant time (`hmac.compare_digest`,
no early exit), so neither the comparison nor the entry's position tells how close a guess was.
`KeyRing.reload` (on SIGHUP) swaps in the re-read file at once; a file that does not read keeps
the keys in force and says why.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import secrets
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from ragkv.core.errors import InputError
from ragkv.core.scope import Scope
from ragkv.core.text import listed

log = logging.getLogger("ragkv")

STORE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_KEY_FIELDS = {"tenant", "sha256", "stores", "filters", "max_tokens", "requests_per_minute"}
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def key_digest(key: str) -> bytes:
    """What the file holds of a key: sha256 of its UTF-8 bytes."""
    return hashlib.sha256(key.encode()).digest()


def new_key() -> str:
    """A fresh random key (256 bits)."""
    return "rk-" + secrets.token_urlsafe(32)


@dataclass(frozen=True)
class Caller:
    """Who sent a request, as its key says: the scope its retrievals run in, the stores it may
    use (None: all), its answers' token cap and its rate (None: none)."""

    scope: Scope | None = None
    stores: tuple[str, ...] | None = None
    max_tokens: int | None = None
    requests_per_minute: float | None = None
    digest: bytes = b""  # which key (its hash): what its rate is counted by

    @property
    def tenant(self) -> str:
        return self.scope.tenant if self.scope is not None else ""

    def may_use(self, store: str) -> bool:
        return self.stores is None or store in self.stores


ANYONE = Caller()  # without keys, every request is this caller


@dataclass(frozen=True)
class KeyFile:
    """A keys file, read: its keys (by hash) and the stores it names (name -> path)."""

    keys: tuple[Caller, ...]
    stores: Mapping[str, str] = field(default_factory=dict)

    def find(self, sent: str) -> Caller | None:
        """The caller whose key is `sent`, or None. Every entry is compared, whatever matches."""
        digest, found = key_digest(sent), None
        for caller in self.keys:
            if hmac.compare_digest(digest, caller.digest):
                found = caller
        return found


def read_keys(path: str | Path) -> KeyFile:
    """The keys file at `path`; InputError naming the file and the first problem."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise InputError(f"cannot read keys file {path}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"keys file {path} is not TOML: {exc}") from None
    try:
        return parse_keys(data)
    except InputError as exc:
        raise InputError(f"keys file {path}: {exc}") from None


def parse_keys(data: Mapping[str, Any]) -> KeyFile:
    unknown = sorted(set(data) - {"keys", "stores"})
    if unknown:
        raise InputError(f"unknown table(s) {listed(unknown)}; a keys file has [stores] and [[keys]]")
    stores = data.get("stores", {})
    if not isinstance(stores, Mapping) or not all(isinstance(p, str) and p for p in stores.values()):
        raise InputError('[stores] maps names to store paths: handbook = "/srv/ragkv/handbook"')
    for name in stores:
        check_store_name(name)
    entries = data.get("keys", [])
    if not isinstance(entries, list) or not entries:
        raise InputError("no [[keys]] entries: every request would be refused")
    keys = tuple(_caller(entry, number) for number, entry in enumerate(entries, 1))
    if len({k.digest for k in keys}) < len(keys):
        raise InputError("two [[keys]] entries have the same sha256")
    return KeyFile(keys, dict(stores))


def _caller(entry: Any, number: int) -> Caller:
    where = f"[[keys]] entry {number}"
    if not isinstance(entry, Mapping):
        raise InputError(f"{where} is not a table")
    unknown = sorted(set(entry) - _KEY_FIELDS)
    if unknown:
        raise InputError(f"{where}: unknown field(s) {listed(unknown)} (fields: {', '.join(sorted(_KEY_FIELDS))})")
    tenant, digest = entry.get("tenant"), entry.get("sha256")
    if not isinstance(tenant, str) or not tenant:
        raise InputError(f"{where} names no tenant")
    if not isinstance(digest, str) or not _SHA256.match(digest):
        raise InputError(f"{where}: sha256 must be 64 lowercase hex digits (ragkv key prints one)")
    stores = entry.get("stores")
    if stores is not None and (not isinstance(stores, list) or not all(isinstance(s, str) for s in stores)):
        raise InputError(f"{where}: stores is a list of store names")
    filters = entry.get("filters", [])
    filters = [filters] if isinstance(filters, str) else filters
    if not isinstance(filters, list) or not all(isinstance(f, str) for f in filters):
        raise InputError(f"{where}: filters is a list of filters")
    max_tokens, rate = entry.get("max_tokens"), entry.get("requests_per_minute")
    if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 1):
        raise InputError(f"{where}: max_tokens must be a whole number of at least 1")
    if rate is not None and (type(rate) not in (int, float) or not 0 < rate <= 1e6):
        raise InputError(f"{where}: requests_per_minute must be a number above 0")
    try:
        scope = Scope(tenant, tuple(filters))
    except InputError as exc:
        raise InputError(f"{where}: {exc}") from None
    return Caller(scope, tuple(stores) if stores is not None else None, max_tokens, rate, bytes.fromhex(digest))


def check_store_name(name: str) -> str:
    if not isinstance(name, str) or not STORE_NAME.match(name):
        raise InputError(f"store name {str(name)[:80]!r} must be letters, digits, '.', '_' or '-' (at most 64)")
    return name


def parse_store_options(values: Sequence[str]) -> dict[str, str]:
    """`--store NAME=PATH` (repeatable) as name -> path; one value without a name serves under
    the name "ragkv". InputError for a bad name or a name given twice."""
    stores: dict[str, str] = {}
    for value in values:
        name, _, path = (
            value.partition("=") if "=" in value and "://" not in value.split("=", 1)[0] else ("", "", value)
        )
        name = check_store_name(name) if name else "ragkv"
        if name in stores:
            raise InputError(f"store name {name!r} is given twice; give each --store NAME=PATH its own name")
        if not path:
            raise InputError(f"--store {value!r} names no path: use --store NAME=PATH")
        stores[name] = path
    return stores


class KeyRing:
    """The keys in force: read from `path`, re-read by `reload` (SIGHUP). `find` reads one
    reference, swapped whole by a reload, so a request never sees half a file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.keys = read_keys(self.path)
        self._lock = threading.Lock()

    def find(self, sent: str) -> Caller | None:
        return self.keys.find(sent)

    def reload(self) -> bool:
        """Re-read the file; on a problem keep the keys in force (said in the log). Returns
        whether the new file took effect."""
        with self._lock:
            try:
                keys = read_keys(self.path)
            except InputError as exc:
                log.warning("keys not reloaded, the old keys stay in force: %s", exc)
                return False
            if set(keys.stores) != set(self.keys.stores):
                log.warning("keys reloaded; a change to [stores] takes a restart (the stores served are unchanged)")
            self.keys = keys
            log.warning("keys reloaded from %s: %d keys", self.path, len(keys.keys))
            return True


class RateLimits:
    """Requests per minute per key: a token bucket each, refilled continuously. Used on the event
    loop's thread only."""

    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._buckets: dict[bytes, tuple[float, float]] = {}  # digest -> (tokens, when)

    def wait_s(self, caller: Caller) -> float:
        """0 when `caller` may go now (and counts the request), else seconds until it may."""
        rate = caller.requests_per_minute
        if rate is None:
            return 0.0
        now, burst = self._clock(), max(1.0, rate / 6)  # up to 10 s of its rate at once
        tokens, then = self._buckets.get(caller.digest, (burst, now))
        tokens = min(burst, tokens + (now - then) * rate / 60.0)
        if tokens < 1.0:
            self._buckets[caller.digest] = (tokens, now)
            return (1.0 - tokens) * 60.0 / rate
        self._buckets[caller.digest] = (tokens - 1.0, now)
        return 0.0
