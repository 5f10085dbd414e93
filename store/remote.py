"""Stores on S3-compatible object storage: `--store s3://bucket/prefix`.

The objects mirror a local store's layout (`CURRENT`, `catalog-N.duckdb`, `manifest-N.json`,
`base-*.duckdb`, `segments/*` (vectors and words), `shards/*.safetensors`; see store.generations). Every
machine keeps a local mirror under the ragkv cache (`$RAGKV_HOME/s3/BUCKET/PREFIX`) that is
itself a local store: DuckDB and FAISS only ever open local files (DuckDB's httpfs is not
needed). A reader moving to a new generation downloads its delta and manifest and only the
bases and segments it does not have yet: those are immutable and uniquely named, so what a
change costs to fetch is what changed. A shard's first read fetches just the entry's bytes
(ranged GETs) while the whole shard is copied down in the background for later reads, and
copies are evicted least-recently-used beyond `$RAGKV_S3_CACHE_BYTES` (default 8 GiB).

Writing: a StoreWriter over the mirror with an `S3Transport` (store.transport) takes the store's
`LOCK` object (`BucketLock`), builds the next generation in the mirror, uploads each shard as
it is sealed, and publishes
by uploading the new base and segments (if any), the delta and manifest, and then `CURRENT`
(one PUT, atomic on S3). A writer killed at any moment leaves the published objects as they
were; shards it uploaded are unreferenced until `gc` deletes them.
The last KEEP_GENERATIONS published generations stay on the bucket for readers that open
one while a writer publishes the next.

Credentials, region and endpoint come from the usual AWS settings (`AWS_ACCESS_KEY_ID`,
`AWS_SECRET_ACCESS_KEY`, `AWS_PROFILE`, `AWS_REGION`, `AWS_ENDPOINT_URL[_S3]` for
S3-compatible servers), read by pyarrow's S3 filesystem.

The LOCK object is advisory: S3 offers no atomic create here, so two writers started within
the same second may both proceed. Run one writer per store (the nightly job) and let readers
be many. A LOCK left by a dead writer on the same machine is taken over; one from another
machine must be deleted by hand (the error says so).
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

from ragkv.core.config import cache_dir
from ragkv.core.errors import StoreCorruptError, StoreLockedError
from ragkv.store.generations import (
    CURRENT,
    LOCK,
    SEGMENT_DIR,
    WriteLock,
    catalog_path,
    manifest_path,
    named_files,
    publish,
    read_current,
    read_manifest,
    remove_retired,
    remove_unshared,
    segment_files,
    vectors_path,
    write_atomic,
)
from ragkv.store.kv.shard_copies import ShardCopies
from ragkv.store.kv.shards import is_shard_name
from ragkv.store.objects import FolderObjects, Location, Objects, filesystem, is_remote, read_error

SYNCED = ".remote-CURRENT"  # in the mirror: the bucket's CURRENT it last copied
KEEP_GENERATIONS = 2
CACHE_BYTES_ENV = "RAGKV_S3_CACHE_BYTES"
DEFAULT_CACHE_BYTES = 8 << 30
_COPY_BLOCK = 8 << 20


class RemoteStore:
    """One S3 store and this machine's mirror of it (its objects: store.objects.Objects)."""

    shared = True  # machines that never take the bucket's lock leave what they write pending

    def __init__(self, uri: str, fs=None):
        self.location = Location.parse(uri)
        self.fs = fs or filesystem()
        self.mirror = cache_dir() / "s3" / self.location.bucket / (self.location.prefix or "_")
        (self.mirror / "shards").mkdir(parents=True, exist_ok=True)
        self.downloaded = 0  # bytes of catalogs, manifests and segments copied down (not shards)
        # the shards' local copies, for readers
        self.copies = ShardCopies(
            self.mirror / "shards",
            self.location,
            self.fs,
            self.download,
            int(os.environ.get(CACHE_BYTES_ENV, DEFAULT_CACHE_BYTES)),
        )

    # -- objects (store.objects.Objects) --------------------------------------------------------
    @property
    def uri(self) -> str:
        return self.location.uri

    def names(self, folder: str) -> dict[str, int]:
        return self._list(folder)

    def get(self, name: str) -> bytes | None:
        return self.read_object(name)

    def put(self, name: str, data: bytes) -> None:
        self.put_object(name, data)  # one PUT: never seen partial

    def publish(self, name: str) -> None:
        local = self.mirror / name
        self._upload(local, name)
        local.unlink(missing_ok=True)  # the bucket holds it now; keep no local copy

    def fetch(self, name: str) -> Path:
        local = self.mirror / name
        if not local.exists():
            local.parent.mkdir(parents=True, exist_ok=True)
            self.download(name, local)
        return local

    def delete(self, name: str) -> None:
        try:
            self.delete_object(name)
        except FileNotFoundError:
            pass
        (self.mirror / name).unlink(missing_ok=True)

    def drop_copy(self, name: str) -> None:
        (self.mirror / name).unlink(missing_ok=True)

    def read_object(self, name: str) -> bytes | None:
        try:
            with self.fs.open_input_stream(self.location.key(name)) as f:
                return f.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise read_error(self.location.uri, exc) from exc

    def put_object(self, name: str, data: bytes) -> None:
        with self.fs.open_output_stream(self.location.key(name)) as f:
            f.write(data)

    def delete_object(self, name: str) -> None:
        self.fs.delete_file(self.location.key(name))

    def _upload(self, path: Path, name: str) -> None:
        with open(path, "rb") as src, self.fs.open_output_stream(self.location.key(name)) as dst:
            while block := src.read(_COPY_BLOCK):
                dst.write(block)

    def download(self, name: str, path: Path) -> None:
        """Copy an object to `path` atomically (temporary name, then rename)."""
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            with self.fs.open_input_stream(self.location.key(name)) as src, open(tmp, "wb") as dst:
                while block := src.read(_COPY_BLOCK):
                    dst.write(block)
                    if not name.startswith("shards/"):
                        self.downloaded += len(block)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    def _list(self, folder: str = "") -> dict[str, int]:
        from pyarrow import fs

        base = self.location.key(folder) if folder else self.location.key()
        try:
            infos = self.fs.get_file_info(fs.FileSelector(base, allow_not_found=True))
        except OSError as exc:
            raise read_error(self.location.uri, exc) from exc
        return {info.base_name: info.size for info in infos if info.type == fs.FileType.File}

    # -- generations --------------------------------------------------------------------------
    def sync(self) -> int | None:
        """Make the mirror's published generation the bucket's (copying its catalog and index
        down when the bucket published something new). Returns that generation, or None if
        nothing is published. CURRENT on the bucket carries a token per publish, so a bucket
        emptied and rebuilt (same generation numbers, other content) is never mistaken for
        what the mirror holds."""
        body = self.read_object(CURRENT)
        marker = self.mirror / SYNCED
        seen = marker.read_bytes() if marker.exists() else None
        if body is None:
            if seen is not None:  # the store this mirror copied is gone from the bucket
                self._reset_mirror()
            else:  # a first writer published here but never on the bucket: keep its shards to adopt
                (self.mirror / CURRENT).unlink(missing_ok=True)
            return None
        generation = int(body.decode().split()[0])
        stale = body != seen
        if stale or read_current(self.mirror) != generation:
            self.fetch_generation(generation, fresh=stale)
            publish(self.mirror, generation)
            write_atomic(marker, body)
            self._trim_mirror(generation)
        return generation

    def fetch_generation(self, generation: int, fresh: bool = True) -> None:
        """Copy a generation down: its delta and manifest (again when `fresh`: the bucket may
        have been rebuilt with the same numbers), and the bases and segments it names that the
        mirror lacks (never again: their names are unique). A format-1 generation: its catalog
        and index."""

        def need(name: str, path: Path, again: bool) -> None:
            if again or not path.exists():
                try:
                    self.download(name, path)
                except FileNotFoundError:
                    raise StoreCorruptError(
                        f"store {self.location.uri}: CURRENT names generation {generation} but {name} is missing"
                    ) from None

        manifest = manifest_path(self.mirror, generation)
        try:
            need(manifest.name, manifest, fresh)
        except StoreCorruptError:  # format 1: no manifest, one index file
            need(vectors_path(self.mirror, generation).name, vectors_path(self.mirror, generation), fresh)
            need(catalog_path(self.mirror, generation).name, catalog_path(self.mirror, generation), fresh)
            return
        need(catalog_path(self.mirror, generation).name, catalog_path(self.mirror, generation), fresh)
        named = read_manifest(self.mirror, generation)
        need(named["base"], self.mirror / named["base"], False)
        (self.mirror / SEGMENT_DIR).mkdir(exist_ok=True)
        for name in segment_files(named):
            need(f"{SEGMENT_DIR}/{name}", self.mirror / SEGMENT_DIR / name, False)

    def _reset_mirror(self) -> None:
        for path in self.mirror.iterdir():
            if path.is_file() and path.name != LOCK:
                path.unlink(missing_ok=True)
        for folder in ("shards", SEGMENT_DIR):
            if (self.mirror / folder).is_dir():
                for path in (self.mirror / folder).iterdir():
                    path.unlink(missing_ok=True)

    def _trim_mirror(self, generation: int) -> None:
        """Drop older mirrored generations nobody reads, unless a local writer is busy."""
        try:
            lock = WriteLock(self.mirror, wait=False)
        except StoreLockedError:
            return
        try:
            remove_retired(self.mirror, generation)
            remove_unshared(self.mirror)
        finally:
            lock.release()

    def upload_generation(self, generation: int) -> None:
        """Publish: the base and segments the bucket lacks, the delta and manifest, and CURRENT
        (with a fresh token) last."""
        named = read_manifest(self.mirror, generation)
        if named["base"] not in self._list():
            self._upload(self.mirror / named["base"], named["base"])
        on_bucket = self._list(SEGMENT_DIR)
        for name in segment_files(named):
            if name not in on_bucket:
                self._upload(self.mirror / SEGMENT_DIR / name, f"{SEGMENT_DIR}/{name}")
        for path in (catalog_path(self.mirror, generation), manifest_path(self.mirror, generation)):
            self._upload(path, path.name)
        body = f"{generation}\n{uuid.uuid4().hex}\n".encode()
        self.put_object(CURRENT, body)
        write_atomic(self.mirror / SYNCED, body)

    def remote_generations(self) -> set[int]:
        names = self._list()
        return {int(n.split("-")[1].split(".")[0]) for n in names if n.startswith("catalog-") and n.endswith(".duckdb")}

    def trim_generations(self, current: int) -> list[int]:
        """Delete published generations older than the last KEEP_GENERATIONS, then the bases
        and segments no kept generation names."""
        names = self._list()
        old = sorted(g for g in self.remote_generations() if g <= current - KEEP_GENERATIONS)
        for generation in old:
            for path in (
                catalog_path(self.mirror, generation),
                vectors_path(self.mirror, generation),
                manifest_path(self.mirror, generation),
            ):
                if path.name in names:
                    self.fs.delete_file(self.location.key(path.name))
        wanted: set[str] = set()
        for generation in self.remote_generations():
            body = self.read_object(manifest_path(self.mirror, generation).name)
            if body is not None:
                wanted |= named_files(json.loads(body))
        for name in names:
            if name.startswith("base-") and name not in wanted:
                self.fs.delete_file(self.location.key(name))
        for name in self._list(SEGMENT_DIR):
            if f"{SEGMENT_DIR}/{name}" not in wanted:
                self.fs.delete_file(self.location.key(SEGMENT_DIR, name))
        return old

    # -- shards -------------------------------------------------------------------------------
    def shards(self) -> dict[str, int]:
        return {name: size for name, size in self._list("shards").items() if is_shard_name(name)}

    def upload_shard(self, name: str) -> None:
        self._upload(self.mirror / "shards" / name, f"shards/{name}")

    def delete_shard(self, name: str) -> None:
        self.fs.delete_file(self.location.key("shards", name))


def objects_at(location: str | Path) -> Objects:
    """The objects of the store at `location` (a folder, or s3://bucket/prefix)."""
    if is_remote(location):
        return RemoteStore(str(location))
    return FolderObjects(Path(location))
