"""KV a reader computed on misses, left for the store's one writer to fold in.

A process reading an S3 store is never its writer: it never takes the bucket's lock. The KV it
computes on a miss goes under the store's `pending/` area as two immutable objects named by a
fresh id, the manifest written last:

    pending/<id>.safetensors   the entries, sealed as a shard of `shards/` is (id: time, then random)
    pending/<id>.json          the manifest: per entry its key, chunk, token ids, span and checksum
    pending/<id>.hits.jsonl    uses it logged (ragkv.store.kv.popularity's lines), one object per flush

An object whose manifest is missing is incomplete (a replica killed mid-upload): a fold never
takes it, and one deletes it once it is an hour old. A reader keeps at most `pending_bytes` of its own
objects, dropping its oldest first (counted).

A reader's uses are buffered and left as one hits object `HITS_FLUSH_S` seconds after the
first, on `flush`, on close, and when the process exits without closing (an engine embedded in
another, as vLLM's offline LLM is); a replica killed -9 loses at most that much of its count.

The writer folds (`ragkv fold`, and every ingest or `reindex` before its work): the hits
objects first, into popularity (each object's size is recorded as folded, so a fold killed
after publishing and before deleting never counts one twice); then each entry is
verified against its checksum, then handed to the same commit as a local write-back (chunk
still there, key not stored yet, the budget's admission), and the objects go once the
generation is published. Two replicas that computed one chunk store it once. A damaged object
is skipped with one warning and deleted.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from ragkv.core.errors import StoreCorruptError
from ragkv.store.kv.shards import SHARD_SUFFIX, ShardReader, ShardWriter
from ragkv.store.remote import objects_at

log = logging.getLogger("ragkv")

PENDING_DIR = "pending"
MANIFEST_SUFFIX = ".json"
HITS_SUFFIX = ".hits.jsonl"
STALE_S = 3600.0  # an object without a manifest this old was left by a killed replica
PENDING_LIST_S = 1.0  # a reader lists the fleet's pending KV at most this often (on a miss)


@dataclass(frozen=True)
class ComputedKV:
    """KV computed for a chunk on a miss, encoded as it is stored."""

    profile_id: str
    kv_key: str
    chunk_id: int
    token_ids: tuple[int, ...]
    parts: dict[str, torch.Tensor]  # codec.encode output: "" the data, others e.g. scales
    shard_metadata: dict[str, str]
    span_start: int | None = None  # chunk_index of the span its KV continues (None: stored alone)
    parent: str | None = None  # the key of the entry before it in its span (None: none)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts.values())


class PendingArea:
    """The `pending/` objects of one store (store.objects: a folder's files, or a bucket's
    objects read through a local staging folder)."""

    def __init__(self, location: str | Path):
        self.objects = objects_at(location)
        self.dir = self.objects.mirror / PENDING_DIR  # made by the first reader that leaves something

    def names(self) -> dict[str, int]:
        """Every pending object's name and size."""
        return self.objects.names(PENDING_DIR)

    def put(self, path: Path) -> None:
        """Publish the local file `path` (in `self.dir`) as the object of its name."""
        self.objects.publish(f"{PENDING_DIR}/{path.name}")

    def put_bytes(self, name: str, data: bytes) -> None:
        """Publish `data` as object `name`, whole or not at all."""
        self.objects.put(f"{PENDING_DIR}/{name}", data)

    def read_bytes(self, name: str) -> bytes | None:
        """Object `name`'s bytes (None: gone)."""
        return self.objects.get(f"{PENDING_DIR}/{name}")

    def fetch(self, name: str) -> Path:
        """A local copy of object `name`, for reading."""
        return self.objects.fetch(f"{PENDING_DIR}/{name}")

    def delete(self, name: str) -> None:
        """Delete object `name` (gone already: nothing to do)."""
        self.objects.delete(f"{PENDING_DIR}/{name}")

    def drop_copy(self, name: str) -> None:
        """Drop this machine's copy of object `name`, which the store no longer lists."""
        self.objects.drop_copy(f"{PENDING_DIR}/{name}")


@dataclass
class PendingReport:
    written: int = 0  # entries left pending
    objects: int = 0  # pending objects written
    dropped: int = 0  # own objects deleted to stay within pending_bytes
    dropped_entries: int = 0
    bytes: int = 0  # uploaded (shards and manifests)


def new_object_id() -> str:
    """A fresh object's id: 16 hex of the time (so names sort oldest first), 16 random."""
    return f"{time.time_ns():016x}{uuid.uuid4().hex[:16]}"


@dataclass(frozen=True)
class PendingEntry:
    """An entry a replica left pending: its key, where it is, and the chunk's own token ids."""

    kv_key: str
    shard: str
    checksum: str
    token_ids: tuple[int, ...]


class PendingIndex:
    """The KV the fleet left pending, by key: a reader of an S3 store looks here before it
    computes a miss, so a chunk one replica computed is not computed again by another while it
    waits for the fold. The listing is read again at most every `list_s` seconds, and only
    for a key it lacks; a manifest is read once, a pending shard copied down when first used
    (and its copy deleted once the fold took it)."""

    def __init__(self, area: PendingArea, list_s: float = PENDING_LIST_S):
        self.area = area
        self.list_s = list_s
        self._entries: dict[str, PendingEntry] = {}
        self._read: set[str] = set()  # manifests read
        self._listed = float("-inf")

    def lookup(self, key: str) -> PendingEntry | None:
        """Where pending entry `key` is; None if nothing pending has it (as last listed)."""
        if key not in self._entries and time.monotonic() - self._listed >= self.list_s:
            self._refresh()
        return self._entries.get(key)

    def find(self, key: str) -> dict[str, torch.Tensor] | None:
        """The encoded parts of pending entry `key`, verified; None if nothing pending has it
        (or what has it cannot be read: then it is computed, as any miss)."""
        entry = self.lookup(key)
        if entry is None:
            return None
        try:
            return read_pending(self.area, entry.shard, key, entry.checksum)
        except (OSError, StoreCorruptError):  # folded and deleted meanwhile, or damaged
            self._entries.pop(key, None)
            return None

    def _refresh(self) -> None:
        self._listed = time.monotonic()
        try:
            names = self.area.names()
        except OSError:
            return
        for name in sorted(n for n in names if n.endswith(MANIFEST_SUFFIX) and n not in self._read):
            self._read.add(name)
            try:
                data = self.area.read_bytes(name)
                manifest = json.loads(data) if data else {}
                for e in manifest.get("entries", ()):
                    found = PendingEntry(e["kv_key"], manifest["shard"], e["checksum"], tuple(e["token_ids"]))
                    self._entries.setdefault(found.kv_key, found)
            except (OSError, ValueError, KeyError, TypeError):
                continue  # a damaged manifest: the fold deletes it
        self._read &= set(names)
        gone = {e.shard for e in self._entries.values() if e.shard not in names}
        self._entries = {k: e for k, e in self._entries.items() if e.shard not in gone}
        for shard in gone:  # this reader's copies of what the fold took
            self.area.drop_copy(shard)


def read_pending(area: PendingArea, shard: str, key: str, checksum: str) -> dict[str, torch.Tensor]:
    """The encoded parts of entry `key` of pending `shard`, verified (copied down first, on
    S3). OSError when the fold took it meanwhile; StoreCorruptError when it is damaged."""
    reader = ShardReader(area.dir)
    try:
        area.fetch(shard)
        return {p: t.clone() for p, t in reader.read_parts(shard, key, checksum).items()}
    finally:
        reader.close()


class PendingWriter:
    """A reader's pending objects: each batch of computed KV one shard and its manifest."""

    def __init__(self, location: str | Path, pending_bytes: int):
        self.area = PendingArea(location)
        self.pending_bytes = pending_bytes
        self.report = PendingReport()
        self._own: list[tuple[str, int, int]] = []  # (id, bytes, entries), oldest first

    def put(self, batch: list[ComputedKV]) -> None:
        """Leave `batch` pending: sealed into a shard, then its manifest (data before index)."""
        object_id = new_object_id()
        self.area.dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=self.area.dir, prefix=".stage-") as stage:
            sealed = ShardWriter(Path(stage), 1 << 62, batch[0].shard_metadata)
            for item in batch:
                sealed.add(item.kv_key, item.parts)
            entries = {e.name: e for e in sealed.flush()}
            (shard,) = {e.shard for e in entries.values()}
            data = self.area.dir / f"{object_id}{SHARD_SUFFIX}"
            shutil.move(str(Path(stage) / shard), data)
            manifest = {
                "shard": data.name,
                "entries": [
                    {
                        "profile_id": b.profile_id,
                        "kv_key": b.kv_key,
                        "chunk_id": b.chunk_id,
                        "token_ids": list(b.token_ids),
                        "span_start": b.span_start,
                        "parent": b.parent,
                        "checksum": entries[b.kv_key].checksum,
                    }
                    for b in batch
                ],
                "shard_metadata": batch[0].shard_metadata,
            }
            index = self.area.dir / f".{object_id}{MANIFEST_SUFFIX}.tmp"
            index.write_text(json.dumps(manifest))
            final = index.with_name(f"{object_id}{MANIFEST_SUFFIX}")
            index.rename(final)
        size = data.stat().st_size
        self.report.bytes += size + final.stat().st_size
        self.area.put(data)  # on S3: uploaded, and the local copy dropped
        self.area.put(final)  # last: its presence says the object is whole
        self._own.append((object_id, size, len(batch)))
        self.report.written += len(batch)
        self.report.objects += 1
        self._bound()

    def _bound(self) -> None:
        """Drop this reader's oldest objects while it holds more than `pending_bytes`."""
        while self._own and sum(size for _, size, _ in self._own) > self.pending_bytes:
            object_id, _, num_entries = self._own.pop(0)
            self.area.delete(f"{object_id}{MANIFEST_SUFFIX}")  # first: a half-deleted object is incomplete
            self.area.delete(f"{object_id}{SHARD_SUFFIX}")
            self.report.dropped += 1
            self.report.dropped_entries += num_entries


@dataclass
class FoldedPending:
    """What a fold found: whole objects, their entries, and the objects it left or deleted."""

    items: list[ComputedKV]
    objects: list[str]  # names of the whole objects read (manifest and shard)
    damaged: list[str]  # names of unreadable objects (deleted after the fold)
    stale: list[str]  # shards without a manifest, old enough to be a killed replica's


def read_objects(area: PendingArea, names: dict[str, int] | None = None) -> FoldedPending:
    """Every whole pending object's entries (of `names`, else of a listing made here),
    verified against their checksums."""
    names = area.names() if names is None else names
    found = FoldedPending([], [], [], [])
    now = time.time()
    for name in sorted(n for n in names if n.endswith(MANIFEST_SUFFIX)):
        try:
            manifest = json.loads(area.fetch(name).read_text())
            shard = manifest["shard"]
            reader = ShardReader(area.dir)
            try:
                area.fetch(shard)
                items = [
                    ComputedKV(
                        e["profile_id"],
                        e["kv_key"],
                        int(e["chunk_id"]),
                        tuple(e["token_ids"]),
                        {p: t.clone() for p, t in reader.read_parts(shard, e["kv_key"], e["checksum"]).items()},
                        dict(manifest["shard_metadata"]),
                        e.get("span_start"),
                        e.get("parent"),
                    )
                    for e in manifest["entries"]
                ]
            finally:
                reader.close()
        except (OSError, ValueError, KeyError, TypeError, StoreCorruptError) as exc:
            found.damaged += [name, name.removesuffix(MANIFEST_SUFFIX) + SHARD_SUFFIX]
            log.warning("pending KV %s/%s is damaged (%s); skipped and deleted", PENDING_DIR, name, exc)
            continue
        found.items += items
        found.objects += [name, shard]
    whole = {n.removesuffix(MANIFEST_SUFFIX) for n in names if n.endswith(MANIFEST_SUFFIX)}
    for name in names:
        if name.endswith(SHARD_SUFFIX) and name.removesuffix(SHARD_SUFFIX) not in whole:
            if now - _created(name) > STALE_S:
                found.stale.append(name)
    return found


def _created(name: str) -> float:
    """When the object `name` was made (its id starts with the nanoseconds in hex); 0 if unknown."""
    try:
        return int(name[:16], 16) / 1e9
    except ValueError:
        return 0.0
