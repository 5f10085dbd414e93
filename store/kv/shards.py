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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ragkv.core.errors import StoreCorruptError
from ragkv.core.formats import SHARD_FORMAT
from ragkv.store.kv.shard_files import LocalFile, RemoteFile, RemoteShards

SHARD_SUFFIX = ".safetensors"
_SHARD_NAME = re.compile(r"^[0-9a-f]{32}\.safetensors$")


PART_SEPARATOR = "#"  # an entry's extra tensors (e.g. int8 scales) are stored as f"{name}#{part}"


def _raw(tensor: torch.Tensor):
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def checksum(tensor: torch.Tensor | dict[str, torch.Tensor]) -> str:
    """xxh3-64 of an entry's raw bytes (any dtype; a dict's parts in name order), as hex."""
    parts = tensor if isinstance(tensor, dict) else {"": tensor}
    digest = xxhash.xxh3_64()
    for part in sorted(parts):
        digest.update(_raw(parts[part]))
    return digest.hexdigest()


def _as_parts(kv: torch.Tensor | dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    parts = kv if isinstance(kv, dict) else {"": kv}
    return {part: t.detach().cpu().contiguous() for part, t in parts.items()}


def _stored_name(name: str, part: str) -> str:
    return f"{name}{PART_SEPARATOR}{part}" if part else name


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


def _entry(name: str, shard: str, parts: dict[str, torch.Tensor], digest: str) -> SealedEntry:
    data = parts[""]
    return SealedEntry(
        name=name,
        shard=shard,
        num_tokens=data.shape[3],
        dtype=str(data.dtype).removeprefix("torch."),
        nbytes=sum(t.numel() * t.element_size() for t in parts.values()),
        checksum=digest,
    )


class ShardWriter:
    """Collects canonical `(L, 2, H, T, D)` KV tensors and seals them into shards of about
    `max_bytes`. `add` and `flush` return the entries of any shard they sealed."""

    def __init__(self, shard_dir: Path, max_bytes: int, metadata: dict[str, str]):
        self.shard_dir = shard_dir
        self.max_bytes = max_bytes
        self.metadata = {"format": "ragkv-kv-shard", "format_version": SHARD_FORMAT, **metadata}
        self._pending: dict[str, dict[str, torch.Tensor]] = {}
        self._pending_bytes = 0
        shard_dir.mkdir(parents=True, exist_ok=True)

    def add(self, name: str, kv: torch.Tensor | dict[str, torch.Tensor]) -> list[SealedEntry]:
        """Queue one entry: a canonical `(L, 2, H, T, D)` tensor, or its encoded parts ("" the
        data, others e.g. scales). Seals the shard once it is full enough."""
        if name in self._pending:
            return []
        parts = _as_parts(kv)
        self._pending[name] = parts
        self._pending_bytes += sum(t.numel() * t.element_size() for t in parts.values())
        return self.flush() if self._pending_bytes >= self.max_bytes else []

    def flush(self) -> list[SealedEntry]:
        """Seal whatever is queued into one shard (durably) and return its entries."""
        if not self._pending:
            return []
        shard = f"{uuid.uuid4().hex}{SHARD_SUFFIX}"
        final = self.shard_dir / shard
        tmp = self.shard_dir / f".{shard}.tmp"
        digests = {name: checksum(parts) for name, parts in self._pending.items()}
        tensors = {_stored_name(name, part): t for name, parts in self._pending.items() for part, t in parts.items()}
        try:
            try:
                save_file(tensors, str(tmp), metadata={**self.metadata, "checksums": json.dumps(digests)})
            except SafetensorError as exc:  # safetensors reports I/O failures (disk full) in its own type
                raise OSError(f"cannot write shard: {str(exc).split(': ', 1)[-1]}") from exc
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.rename(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(self.shard_dir)
        entries = [_entry(name, shard, parts, digests[name]) for name, parts in self._pending.items()]
        self._pending = {}
        self._pending_bytes = 0
        return entries


_DTYPES = {
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "F64": torch.float64,
    "I32": torch.int32,
    "I64": torch.int64,
}


@dataclass(frozen=True)
class _Shard:
    """An open sealed shard: its file, where its data starts, and its tensors."""

    file: LocalFile | RemoteFile
    data_start: int
    tensors: dict  # stored name -> (dtype, shape, begin, end), offsets relative to data_start
    parts: dict  # entry name -> its part names ("" the data)

    @property
    def remote(self) -> bool:
        return isinstance(self.file, RemoteFile)


def _align(size: int) -> int:
    return (size + 7) // 8 * 8


def _aligned_size(parts_info: dict) -> int:
    """Bytes to read an entry's parts into one buffer, each part 8-byte aligned."""
    return sum(_align(end - begin) for _, _, begin, end in parts_info.values())


class ShardReader:
    """Reads entries from sealed shards with `pread` (into a caller's reused buffer when
    given: page faults on a fresh mapping cost ~5x a copy into warm memory), verifying each
    entry's checksum before returning it. Keeps a bounded number of shard files open."""

    MAX_OPEN = 64

    def __init__(self, shard_dir: Path, remote: RemoteShards | None = None):
        self.shard_dir = shard_dir
        self.remote = remote  # shards not (yet) in `shard_dir`: an S3 store's mirror
        self._open: dict[str, _Shard] = {}

    def read(self, shard: str, name: str, expected_checksum: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """The entry's `(L, 2, H, T, D)` data tensor (see `read_parts` for encoded entries)."""
        return self.read_parts(shard, name, expected_checksum, out)[""]

    def read_parts(
        self, shard: str, name: str, expected_checksum: str, out: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        """The entry's stored parts ("" the data, others e.g. int8 scales); raises
        StoreCorruptError if it is missing, truncated, or its bytes do not match
        `expected_checksum`. With `out` (a uint8 tensor with room for every part, 8-byte aligned), the
        parts are views of `out`."""
        opened, names = self._entry(shard, name)
        size = _aligned_size(names)
        buffer = out[:size] if out is not None and out.numel() >= size else torch.empty(size, dtype=torch.uint8)
        parts, offset, digest = {}, 0, xxhash.xxh3_64()
        for part in sorted(names):
            dtype, shape, begin, end = names[part]
            view = buffer[offset : offset + end - begin]
            target = memoryview(view.numpy())  # type: ignore[arg-type] # a uint8 array is a buffer
            self._read_verbatim(shard, name, opened, [target], begin, end, digest)
            parts[part] = view.view(dtype).reshape(shape) if end > begin else torch.empty(shape, dtype=dtype)
            offset += _align(end - begin)
        if digest.hexdigest() != expected_checksum:
            raise StoreCorruptError(f"KV entry {name[:24]}… in shard {shard} fails its checksum")
        return parts

    def layout(self, shard: str, name: str) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """The entry's parts as stored, `part -> (dtype, shape)`, from the shard's header (nothing
        of the data is read). Raises StoreCorruptError if the entry is not in the shard."""
        _, names = self._entry(shard, name)
        return {part: (dtype, tuple(shape)) for part, (dtype, shape, _, _) in names.items()}

    def read_into(self, shard: str, name: str, expected_checksum: str, targets: Sequence[memoryview]) -> None:
        """Read an entry of one part (its data alone, see `layout`) into `targets`, one after
        another in the order of its bytes: scattered straight into where it will be used (a
        cache's layers), with no buffer in between. Verifies the checksum as `read_parts` does;
        when that fails the targets hold the bytes read and the caller drops them."""
        opened, names = self._entry(shard, name)
        if set(names) != {""}:
            raise ValueError(f"KV entry {name[:24]}… has parts {sorted(names)}: read it with read_parts")
        _, _, begin, end = names[""]
        if sum(target.nbytes for target in targets) != end - begin:
            raise ValueError(f"KV entry {name[:24]}… holds {end - begin} bytes; the targets do not")
        digest = xxhash.xxh3_64()
        self._read_verbatim(shard, name, opened, targets, begin, end, digest)
        if digest.hexdigest() != expected_checksum:
            raise StoreCorruptError(f"KV entry {name[:24]}… in shard {shard} fails its checksum")

    def _entry(self, shard: str, name: str) -> tuple[_Shard, dict]:
        """The open shard and the entry's parts in it, `part -> (dtype, shape, begin, end)`."""
        opened = self._shard(shard)
        names = {
            part: opened.tensors[stored]
            for part in opened.parts.get(name, ())
            if (stored := _stored_name(name, part)) in opened.tensors
        }
        if "" not in names:
            raise StoreCorruptError(f"KV entry {name[:24]}… is not in shard {shard}")
        return opened, names

    def _read_verbatim(
        self, shard: str, name: str, opened: _Shard, targets: Sequence[memoryview], begin: int, end: int, digest
    ) -> None:
        """Bytes `[begin, end)` of the shard's data into `targets` in turn, fed to `digest`."""
        offset = opened.data_start + begin
        for target in targets:
            try:
                got = opened.file.read_into(target, offset) if target.nbytes else 0
            except OSError as exc:  # a remote read that failed
                self.close_shard(shard)
                raise StoreCorruptError(
                    f"KV entry {name[:24]}… in shard {shard} could not be read: {str(exc).splitlines()[0]}"
                ) from None
            if got != target.nbytes:
                self.close_shard(shard)
                raise StoreCorruptError(f"KV entry {name[:24]}… in shard {shard} is truncated")
            digest.update(target)
            offset += got
        if offset != opened.data_start + end:
            raise ValueError("the targets do not cover the entry")

    def _shard(self, shard: str) -> _Shard:
        opened = self._open.get(shard)
        if opened is not None and not (opened.remote and self.remote is not None and self.remote.local(shard)):
            return opened
        if opened is not None:  # the background copy has arrived: read locally from now on
            self.close_shard(shard)
        if not is_shard_name(shard):
            raise StoreCorruptError(f"catalog names an invalid shard file {shard!r}")
        opened = self._open_shard(shard)
        if len(self._open) >= self.MAX_OPEN:
            self.close_shard(next(iter(self._open)))
        self._open[shard] = opened
        return opened

    def _open_shard(self, shard: str) -> _Shard:
        path = self.remote.local(shard) if self.remote else self.shard_dir / shard
        try:
            file = LocalFile(path) if path else RemoteFile(self.remote.open(shard))  # type: ignore[union-attr]
        except FileNotFoundError:
            where = self.shard_dir if path else "the bucket"
            raise StoreCorruptError(f"shard {shard} is missing from {where}") from None
        except OSError as exc:  # no permission, a folder where the shard (or shards/) should be, an I/O error
            raise StoreCorruptError(f"shard {shard} cannot be opened: {exc.strerror or exc}") from None
        try:
            return _Shard(file, *_parse_header(file, shard))
        except BaseException:
            file.close()
            raise

    def close_shard(self, shard: str) -> None:
        opened = self._open.pop(shard, None)
        if opened is not None:
            opened.file.close()

    def close(self) -> None:
        for shard in list(self._open):
            self.close_shard(shard)


def _parse_header(file: LocalFile | RemoteFile, shard: str) -> tuple[int, dict, dict]:
    """(data start, tensors, parts) from a safetensors header: 8-byte little-endian length, then JSON."""
    try:
        length = int.from_bytes(file.read(8, 0), "little")
        if not 0 < length < 100 << 20:
            raise ValueError("header length")
        header = json.loads(file.read(length, 8))
        tensors = {
            name: (_DTYPES[info["dtype"]], tuple(info["shape"]), *info["data_offsets"])
            for name, info in header.items()
            if name != "__metadata__"
        }
    except (ValueError, KeyError, TypeError, OverflowError, MemoryError, OSError) as exc:
        raise StoreCorruptError(f"shard {shard} has an unreadable header ({type(exc).__name__})") from None
    parts: dict[str, list[str]] = {}
    for stored in tensors:
        name, _, part = stored.partition(PART_SEPARATOR)
        parts.setdefault(name, []).append(part)
    return 8 + length, tensors, parts


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
        stored = list(handle.keys())
    except Exception:  # not a readable safetensors file
        return
    grouped: dict[str, list[str]] = {}
    for name in stored:
        grouped.setdefault(name.partition(PART_SEPARATOR)[0], []).append(name.partition(PART_SEPARATOR)[2])
    for name, part_names in grouped.items():
        try:
            parts = {part: handle.get_tensor(_stored_name(name, part)) for part in part_names}
        except Exception:
            continue
        digest = checksum(parts)
        if "" in parts and digests.get(name) == digest:
            yield _entry(name, shard, parts, digest)
