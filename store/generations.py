"""Published generations: a store's catalog and vector index are replaced together, atomically.

    CURRENT                 the published generation number (written aside, fsynced, renamed)
    catalog-000007.duckdb   that generation's catalog: a small delta over a base (see
                            store.catalog.overlay; checkpointed, closed, never reopened for writing)
    manifest-000007.json    that generation's base catalog and vector segments
    base-000005.duckdb      a whole catalog some generations' deltas are over (immutable)
    segments/               index segments: seg-*.faiss indexes, vec-*.npy vectors (IVF-PQ), terms-*.safetensors words
                            (immutable; see ragkv.store.index.segments)
    shards/                 KV shards shared by all generations
    LOCK                    held (flock) by the one writer, with its pid

A writer builds generation g+1 from a copy of g's delta (the changes since the last
compaction, not the whole catalog), writes the vectors it added as a new segment and
publishes by renaming CURRENT. Readers open whatever CURRENT names, so they see generation g
or g+1 in full, never a mix, and never contend with the writer's DuckDB lock. Bases and
segments are shared: they are deleted once no generation on disk names them.

A store written by ragkv before segments (format 1) has `catalog-N.duckdb` as a whole catalog
and `vectors-N.faiss` as its one index; it is read as it is, and its first writer migrates it
once (the old files become the first base and segment, hard-linked, not copied).

A reader holds a shared flock on its generation's manifest (`vectors-N.faiss` in format 1;
`ReaderLease`) for as long as it has the generation open. Retired generations are deleted
only when nobody holds that lease, so a long-lived reader never loses the catalog (or,
through gc, the shards) it uses.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import time
import uuid
from collections.abc import Set
from pathlib import Path

from ragkv.core.errors import StoreFormatError, StoreLockedError, StoreNotFoundError
from ragkv.core.formats import STORE_FORMAT, __version__
from ragkv.store.kv.shards import fsync_dir

log = logging.getLogger("ragkv")

CURRENT = "CURRENT"
LOCK = "LOCK"
_POINTER_TMP = re.compile(r"^\.\.?(remote-)?CURRENT\.[0-9a-f]{12}\.tmp$")  # write_atomic's temporary names
_GENERATION_FILE = re.compile(r"^(catalog|vectors|manifest)-(\d{6})\.(duckdb|faiss|json)(\.partial)?(\.wal)?$")
_BASE_FILE = re.compile(r"^base-(\d{6})-[0-9a-f]{8}\.duckdb(\.wal)?$")
SEGMENT_DIR = "segments"
_STALE_TMP_S = 3600  # a temporary file this old belongs to no live process
MANIFEST_FORMAT = STORE_FORMAT
PLAIN_MANIFEST_FORMAT = 2  # what a manifest without "ivfpq" segments is written as (ragkv/core/formats.py)


def catalog_path(root: Path, generation: int) -> Path:
    return root / f"catalog-{generation:06d}.duckdb"


def vectors_path(root: Path, generation: int) -> Path:
    return root / f"vectors-{generation:06d}.faiss"


def manifest_path(root: Path, generation: int) -> Path:
    return root / f"manifest-{generation:06d}.json"


def base_name(generation: int) -> str:
    """A new base's name: unique, so a copy of it (an S3 mirror's) is never stale."""
    return f"base-{generation:06d}-{uuid.uuid4().hex[:8]}.duckdb"


def lease_path(root: Path, generation: int) -> Path:
    """The file a generation's readers hold: its manifest, or a format-1 generation's index."""
    manifest = manifest_path(root, generation)
    return (
        manifest if manifest.exists() or not vectors_path(root, generation).exists() else vectors_path(root, generation)
    )


def is_legacy(root: Path, generation: int) -> bool:
    """A generation in format 1: a whole catalog and one index file, no manifest."""
    return not manifest_path(root, generation).exists() and vectors_path(root, generation).exists()


def read_manifest(root: Path, generation: int) -> dict:
    """A generation's manifest; one written in a format this ragkv does not know (a newer
    ragkv's) is refused, naming both versions."""
    path = manifest_path(root, generation)
    try:
        manifest = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as exc:
        raise StoreFormatError(
            f"store {root}: {path.name} is unreadable ({exc}); run `ragkv verify --repair --store {root}`"
        ) from None
    found = manifest.get("format") if isinstance(manifest, dict) else None
    if found not in (PLAIN_MANIFEST_FORMAT, MANIFEST_FORMAT):
        writer = manifest.get("written_by") if isinstance(manifest, dict) else None
        raise StoreFormatError(
            f"store {root} was written by {'ragkv ' + writer if writer else 'another ragkv'} "
            f"(store format {found}); this is ragkv {__version__}, which reads format "
            f"{PLAIN_MANIFEST_FORMAT} to {MANIFEST_FORMAT}: upgrade ragkv"
        )
    return manifest


def write_manifest(root: Path, generation: int, manifest: dict) -> None:
    """Written as format 3 only when it lists an "ivfpq" segment, which a ragkv reading format 2
    would search without its re-score and could not compact; else as format 2, which it reads."""
    pq = any(segment.get("kind") == "ivfpq" for segment in manifest.get("segments", []))
    record = {**manifest, "format": MANIFEST_FORMAT if pq else PLAIN_MANIFEST_FORMAT, "written_by": __version__}
    write_atomic(manifest_path(root, generation), json.dumps(record, indent=1).encode())


def segment_files(manifest: dict) -> list[str]:
    """The names of the files in SEGMENT_DIR a manifest names: each segment's index file and,
    when it has them, its lexical file and its vectors file (an "ivfpq" segment's). The same
    fields as ragkv.store.index.segments.SegmentInfo.files, listed here: ragkv.store.index.segments imports this module,
    and the layering test refuses the cycle."""
    return [
        name for s in manifest.get("segments", []) for name in (s["name"], s.get("terms"), s.get("vectors")) if name
    ]


def named_files(manifest: dict) -> set[str]:
    """The base and segment files a manifest names, relative to the store's root."""
    return {manifest["base"]} | {f"{SEGMENT_DIR}/{name}" for name in segment_files(manifest)}


def shared_files(root: Path, generations: set[int]) -> set[str]:
    """Names (relative to `root`) of the bases and segments the manifests of `generations` name."""
    names: set[str] = set()
    for generation in generations:
        try:
            names |= named_files(read_manifest(root, generation))
        except (FileNotFoundError, StoreFormatError):
            continue
    return names


def remove_unshared(root: Path, keep: Set[str] = frozenset()) -> int:
    """Delete bases and segments no generation on disk names (and not in `keep`): those of
    retired generations, or a killed writer's. Returns bytes freed. Call only while holding
    the write lock."""
    wanted = shared_files(root, generations_on_disk(root)) | set(keep)
    freed = 0
    candidates = [p for p in root.iterdir() if _BASE_FILE.match(p.name)]
    if (root / SEGMENT_DIR).is_dir():
        now = time.time()
        candidates += [
            p
            for p in (root / SEGMENT_DIR).iterdir()
            if p.suffix in (".faiss", ".safetensors", ".npy")
            or (p.name.endswith(".tmp") and now - _mtime(p) > _STALE_TMP_S)
        ]  # a killed build's, not a live download's
    for path in candidates:
        name = path.name if path.parent == root else f"{SEGMENT_DIR}/{path.name}"
        if name.removesuffix(".wal") not in wanted:
            try:
                freed += path.stat().st_size
                path.unlink()
            except FileNotFoundError:
                pass
    return freed


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return float("inf")


def read_current(root: Path) -> int | None:
    """The published generation, or None if nothing was ever published (or `root` is no folder)."""
    try:
        data = (root / CURRENT).read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise StoreNotFoundError(f"cannot read store {root}: {exc.strerror or exc}") from None
    text = data.decode("ascii", errors="replace").strip()
    if not (text.isdigit() and len(text) <= 12):  # digits 0-9 only, no sign; writers write six
        raise StoreFormatError(
            f"store {root}: CURRENT holds {data[:40]!r}, not a generation number; run "
            "`ragkv verify --repair` to point it at the newest complete generation"
        )
    return int(text)


def publish(root: Path, generation: int) -> None:
    """Make `generation` current, atomically and durably."""
    write_atomic(root / CURRENT, f"{generation}\n".encode())


def write_atomic(path: Path, data: bytes) -> None:
    """Replace `path` with `data` atomically and durably (aside, fsync, rename, fsync the folder)."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")  # unique: mirrors sync from many processes
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def is_store_file(name: str) -> bool:
    """A name a store writer creates at the top of a store."""
    return name in (CURRENT, LOCK, ".remote-CURRENT") or bool(
        _GENERATION_FILE.match(name) or _POINTER_TMP.match(name) or _BASE_FILE.match(name)
    )


def generations_on_disk(root: Path) -> set[int]:
    """Numbers of generations with a published (non-partial) catalog file."""
    found = set()
    for path in root.iterdir():
        match = _GENERATION_FILE.match(path.name)
        if match and match.group(1) == "catalog" and not match.group(4) and not match.group(5):
            found.add(int(match.group(2)))
    return found


def _files_of(root: Path, generation: int) -> list[Path]:
    return [p for p in root.iterdir() if (m := _GENERATION_FILE.match(p.name)) and int(m.group(2)) == generation]


def complete_generations(root: Path) -> set[int]:
    """Generations with both a published catalog and a manifest (format 1: a vectors file),
    readable or not."""
    return {g for g in generations_on_disk(root) if lease_path(root, g).is_file()}


def check_base(root: Path, current: int | None) -> None:
    """Refuse to write on top of `current` unless its files are there and nothing newer than a
    killed writer's leftover (current + 1) is: a CURRENT that names an older generation (damaged,
    or put back by hand) must never make a writer delete or overwrite newer ones."""
    if current is None:
        return
    complete = complete_generations(root)
    if current not in complete:
        raise StoreFormatError(
            f"store {root}: CURRENT names generation {current} but its catalog or manifest is "
            "missing; run `ragkv verify --repair` to point it at the newest complete generation"
        )
    if newer := sorted(g for g in complete if g > current + 1):
        raise StoreFormatError(
            f"store {root}: CURRENT names generation {current}, but generation {newer[-1]} is newer "
            "(CURRENT may be damaged); run `ragkv verify --repair` to point it at the newest"
        )


def remove_unpublished(root: Path, current: int | None) -> None:
    """Delete generation files above `current` (a killed writer's work that was never
    published, so no reader can have it). Call only while holding the write lock, after
    `check_base`."""
    for path in root.iterdir():
        number = (
            m.group(2)
            if (m := _GENERATION_FILE.match(path.name))
            else m.group(1)
            if (m := _BASE_FILE.match(path.name))
            else None
        )
        if number is not None and int(number) > (current or 0):
            path.unlink(missing_ok=True)
    remove_unshared(root)


def remove_retired(root: Path, current: int) -> tuple[list[int], list[int]]:
    """Delete generations older than `current` that no reader holds. Returns (removed, kept
    because a reader holds them). Call only while holding the write lock."""
    removed, held = [], []
    for generation in sorted(generations_on_disk(root) - {current}):
        if generation > current:
            continue
        lease = lease_path(root, generation)
        try:
            fd = os.open(lease, os.O_RDONLY)
        except FileNotFoundError:  # no vectors file: a half-removed generation, nothing to wait for
            fd = None
        try:
            if fd is not None:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            for path in _files_of(root, generation):  # the lease last
                if path != lease:
                    path.unlink(missing_ok=True)
            lease.unlink(missing_ok=True)
            removed.append(generation)
        except BlockingIOError:
            held.append(generation)
        finally:
            if fd is not None:
                os.close(fd)
    return removed, held


def restore_current(root: Path, wait: bool = False) -> int | None:
    """Point a damaged CURRENT (unreadable, naming a generation whose files are gone, or one
    older than a newer complete generation: what `check_base` refuses) at the newest complete
    generation on disk, under the write lock. Returns the generation it now names, or None if
    CURRENT was sound or no complete generation is left to name."""
    lock = WriteLock(root, wait)
    try:
        complete = complete_generations(root)
        try:
            check_base(root, read_current(root))
            return None
        except StoreFormatError:
            if not complete:
                return None
        publish(root, max(complete))
        return max(complete)
    finally:
        lock.release()


class RetiredError(Exception):
    """The generation was deleted between reading CURRENT and taking its lease: read CURRENT again."""


class ReaderLease:
    """A shared flock on a generation's manifest: while held, no writer deletes the generation."""

    def __init__(self, root: Path, generation: int):
        try:
            fd = os.open(lease_path(root, generation), os.O_RDONLY)
        except FileNotFoundError:
            raise RetiredError(generation) from None
        self._fd: int | None = fd
        fcntl.flock(fd, fcntl.LOCK_SH)
        if os.fstat(fd).st_nlink == 0:  # removed after we opened it, before we locked it
            self.release()
            raise RetiredError(generation)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class WriteLock:
    """An exclusive flock on `root/LOCK`, holding the writer's pid for the error message."""

    def __init__(self, root: Path, wait: bool):
        self.path = root / LOCK
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        self._fd: int | None = fd
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            if not wait:
                os.close(fd)
                raise StoreLockedError(
                    f"store {root} is being written by another process (pid {holder}); "
                    "wait for it to finish, or pass --wait to queue behind it"
                ) from None
            log.info("store %s is being written by another process (pid %s); waiting for it", root, holder)
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
