"""The one interface a store's named objects are read and written through, whatever holds them:
a folder (`FolderObjects`), or an S3 bucket with this machine's mirror of it
(`store.remote.RemoteStore`). Names are paths inside the store (`pending/x.safetensors`).
Readers call these verbs and never ask which of the two they have; `shared` says what a
reader may do there: a bucket is shared by machines that never take its lock, so what they
compute or log waits under pending/ for the one writer's fold."""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ragkv.core.errors import InputError, StoreNotFoundError, StoreWriteError

SCHEME = "s3://"


class Objects(Protocol):
    mirror: Path  # the local folder: the store itself, or this machine's copy of the bucket
    shared: bool  # readers on other machines: they leave what they write pending

    @property
    def uri(self) -> str:
        """What the user named: the folder, or the s3:// URI."""
        ...

    def names(self, folder: str) -> dict[str, int]:
        """Every object directly in `folder`: name -> size (none: {})."""
        ...

    def get(self, name: str) -> bytes | None:
        """Object `name`'s bytes (None: there is none)."""
        ...

    def put(self, name: str, data: bytes) -> None:
        """Write `data` as object `name`, seen whole or not at all."""
        ...

    def publish(self, name: str) -> None:
        """The mirror's file `name` becomes object `name` (and leaves the mirror, where that is
        a copy)."""
        ...

    def fetch(self, name: str) -> Path:
        """A local file holding object `name`, for reading."""
        ...

    def delete(self, name: str) -> None:
        """Delete object `name` and any local copy (gone already: nothing to do)."""
        ...

    def drop_copy(self, name: str) -> None:
        """Drop this machine's copy of an object the store no longer lists (a folder keeps no
        copies: nothing to do)."""
        ...


class FolderObjects:
    """A store in a local folder: the objects are its files."""

    shared = False

    def __init__(self, root: Path):
        self.mirror = Path(root)

    @property
    def uri(self) -> str:
        return str(self.mirror)

    def names(self, folder: str) -> dict[str, int]:
        base = self.mirror / folder
        if not base.is_dir():
            return {}
        return {p.name: p.stat().st_size for p in base.iterdir() if p.is_file() and not p.name.startswith(".")}

    def get(self, name: str) -> bytes | None:
        try:
            return (self.mirror / name).read_bytes()
        except FileNotFoundError:
            return None

    def put(self, name: str, data: bytes) -> None:
        path = self.mirror / name
        path.parent.mkdir(parents=True, exist_ok=True)
        staged = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
        staged.write_bytes(data)
        staged.rename(path)

    def publish(self, name: str) -> None:
        pass  # written in place: the file is the object

    def fetch(self, name: str) -> Path:
        return self.mirror / name

    def delete(self, name: str) -> None:
        (self.mirror / name).unlink(missing_ok=True)

    def drop_copy(self, name: str) -> None:
        pass


def is_remote(location: str | Path) -> bool:
    return str(location).startswith(SCHEME)


def absolute(location: str | Path) -> str:
    """`location` as another process must name it: a folder's absolute path, or the S3 URI."""
    return str(location) if is_remote(location) else str(Path(location).resolve())


def filesystem():
    """pyarrow's S3 filesystem configured from the standard AWS environment."""
    from pyarrow import fs

    options = {}
    if endpoint := os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"):
        options["endpoint_override"] = endpoint
    if region := os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION"):
        options["region"] = region
    return fs.S3FileSystem(**options)


@dataclass(frozen=True)
class Location:
    bucket: str
    prefix: str  # no leading or trailing slash; may be empty

    @classmethod
    def parse(cls, uri: str) -> Location:
        rest = uri[len(SCHEME) :].strip("/")
        bucket, _, prefix = rest.partition("/")
        parts = [p for p in prefix.split("/") if p]
        if not bucket or any(p in (".", "..") for p in parts):
            raise InputError(f"invalid store {uri!r}; use s3://BUCKET/PREFIX")
        return cls(bucket, "/".join(parts))

    @property
    def uri(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.prefix}".rstrip("/")

    def key(self, *names: str) -> str:
        return "/".join([self.bucket, *([self.prefix] if self.prefix else []), *names])


def read_error(uri: str, exc: BaseException) -> StoreNotFoundError:
    """The one-line error for a failed read from the bucket."""
    reason = str(exc).splitlines()[0]
    return StoreNotFoundError(f"cannot read store {uri}: {reason}")


def write_error(store: str | Path, exc: BaseException) -> StoreWriteError:
    """The one-line error for a failed write to a store (a folder or a bucket)."""
    reason = getattr(exc, "strerror", None) or (str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    filename = getattr(exc, "filename", None)
    where = f" ({filename})" if filename else ""
    return StoreWriteError(f"cannot write store {store}: {reason}{where}; the published store is unchanged")
