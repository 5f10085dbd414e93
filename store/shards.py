"""KV shards: many entries per safetensors file, sealed once, verified on every read.

A shard is written to a hidden temporary name, fsynced, renamed to its final name and the
directory fsynced, and only then does `ShardWriter` report its entries: the caller commits
catalog rows for entries it has been told are sealed, so no row ever points at a file that
may not exist. Each entry carries an xxh3-64 checksum of its bytes, checked before use; the
shard's own header holds the checksums too, so a sealed shard that no catalog references yet
(its writer was killed) can be verified and adopted instead of recomputed.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
import xxhash
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ragkv.errors import StoreCorruptError

SHARD_FORMAT = "1"
SHARD_SUFFIX = ".safetensors"
_SHARD_NAME = re.compile(r"^[0-9a-f]{32}\.safetensors$")


def checksum(tensor: torch.Tensor) -> str:
    """xxh3-64 of the tensor's raw bytes (any dtype), as hex."""
    raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return xxhash.xxh3_64_hexdigest(raw)


def is_shard_name(name: str) -> bool:
    """Only names ShardWriter makes: a catalog row can never point outside the shard folder."""
    return bool(_SHARD_NAME.match(name))


@dataclass(frozen=True)
class SealedEntry:
    """Where a KV entry lives once its shard is sealed: the catalog row to commit."""

    name: str  # entry name inside the shard (the KV key string)
    shard: str  # shard file name, relative to the shard directory
    num_tokens: int
    dtype: str
    nbytes: int
    checksum: str


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _entry(name: str, shard: str, kv: torch.Tensor, digest: str) -> SealedEntry:
    return SealedEntry(name=name, shard=shard, num_tokens=kv.shape[3], dtype=str(kv.dtype).removeprefix("torch."),
                       nbytes=kv.numel() * kv.element_size(), checksum=digest)


class ShardWriter:
    """Collects canonical `(L, 2, H, T, D)` KV tensors and seals them into shards of about
    `max_bytes`. `add` and `flush` return the entries of any shard they sealed."""

    def __init__(self, shard_dir: Path, max_bytes: int, metadata: dict[str, str]):
        self.shard_dir = shard_dir
        self.max_bytes = max_bytes
        self.metadata = {"format": "ragkv-kv-shard", "format_version": SHARD_FORMAT, **metadata}
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        shard_dir.mkdir(parents=True, exist_ok=True)

    def add(self, name: str, kv: torch.Tensor) -> list[SealedEntry]:
        """Queue one entry (`kv`: `(L, 2, H, T, D)`); seals the shard once it is full enough."""
        if name in self._pending:
            return []
        self._pending[name] = kv.detach().cpu().contiguous()
        self._pending_bytes += kv.numel() * kv.element_size()
        return self.flush() if self._pending_bytes >= self.max_bytes else []

    def flush(self) -> list[SealedEntry]:
        """Seal whatever is queued into one shard (durably) and return its entries."""
        if not self._pending:
            return []
        shard = f"{uuid.uuid4().hex}{SHARD_SUFFIX}"
        final = self.shard_dir / shard
        tmp = self.shard_dir / f".{shard}.tmp"
        digests = {name: checksum(kv) for name, kv in self._pending.items()}
        try:
            try:
                save_file(self._pending, str(tmp), metadata={**self.metadata, "checksums": json.dumps(digests)})
            except SafetensorError as exc:  # safetensors reports I/O failures (disk full) in its own type
                raise OSError(f"cannot write shard: {str(exc).split(': ', 1)[-1]}") from exc
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.rename(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(self.shard_dir)
        entries = [_entry(name, shard, kv, digests[name]) for name, kv in self._pending.items()]
        self._pending = {}
        self._pending_bytes = 0
        return entries


class ShardReader:
    """Reads entries from sealed shards, keeping shard files open (memory-mapped) for reuse."""

    def __init__(self, shard_dir: Path):
        self.shard_dir = shard_dir
        self._handles: dict[str, object] = {}

    def read(self, shard: str, name: str, expected_checksum: str) -> torch.Tensor:
        """The entry's `(L, 2, H, T, D)` tensor; raises StoreCorruptError if it is missing or
        its bytes do not match `expected_checksum`."""
        try:
            tensor = self._handle(shard).get_tensor(name)
        except StoreCorruptError:
            raise
        except Exception as exc:  # safetensors raises on a truncated file or an unknown name
            self._handles.pop(shard, None)
            raise StoreCorruptError(f"KV entry {name[:24]}… in shard {shard} is unreadable: {exc}") from exc
        if checksum(tensor) != expected_checksum:
            raise StoreCorruptError(f"KV entry {name[:24]}… in shard {shard} fails its checksum")
        return tensor

    def _handle(self, shard: str):
        handle = self._handles.get(shard)
        if handle is None:
            if not is_shard_name(shard):
                raise StoreCorruptError(f"catalog names an invalid shard file {shard!r}")
            path = self.shard_dir / shard
            if not path.is_file():
                raise StoreCorruptError(f"shard {shard} is missing from {self.shard_dir}")
            handle = safe_open(str(path), framework="pt")
            self._handles[shard] = handle
        return handle

    def close(self) -> None:
        self._handles.clear()


def shard_files(shard_dir: Path) -> dict[str, int]:
    """Sealed shard names in `shard_dir` with their sizes in bytes."""
    if not shard_dir.is_dir():
        return {}
    return {p.name: p.stat().st_size for p in shard_dir.iterdir() if is_shard_name(p.name)}


def remove_temporary(shard_dir: Path) -> int:
    """Delete half-written shards left by a killed writer; returns the bytes freed. Call only
    while holding the store's write lock."""
    freed = 0
    if shard_dir.is_dir():
        for path in shard_dir.glob(f".*{SHARD_SUFFIX}.tmp"):
            freed += path.stat().st_size
            path.unlink(missing_ok=True)
    return freed


def sealed_entries(shard_dir: Path, shard: str) -> Iterator[SealedEntry]:
    """The entries of a sealed shard that verify against the checksums in its own header.
    Entries that do not verify, and shards without readable headers, yield nothing."""
    try:
        handle = safe_open(str(shard_dir / shard), framework="pt")
        digests = json.loads((handle.metadata() or {}).get("checksums", "{}"))
    except Exception:  # not a readable safetensors file
        return
    for name in handle.keys():
        try:
            kv = handle.get_tensor(name)
        except Exception:
            continue
        digest = checksum(kv)
        if digests.get(name) == digest:
            yield _entry(name, shard, kv, digest)
