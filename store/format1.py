"""The one-time migration of a format-1 store (one whole catalog and vector index per
generation) to segments (a delta per generation over a shared base): the old catalog becomes
the first base and its index the first segment, by hard links where it can (nothing copied)."""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import duckdb

from ragkv.core.errors import StoreFormatError
from ragkv.store.catalog import Catalog
from ragkv.store.generations import SEGMENT_DIR, base_name, catalog_path, vectors_path
from ragkv.store.index.segments import Segment, SegmentInfo, open_flat_file

log = logging.getLogger("ragkv")


@dataclass(frozen=True)
class Migrated:
    base: str  # the new base catalog's file name, under the store's root
    segments: list[SegmentInfo]  # the old index as the first segment (none when it held no vectors)
    dim: int
    loaded: dict[str, Segment]  # that segment, open already


def migrate(root: Path, old_generation: int, generation: int) -> Migrated:
    """Write `generation`'s base and first segment from format-1 generation `old_generation`.
    A catalog of an older schema is copied and migrated instead of linked."""
    old_catalog, old_vectors = catalog_path(root, old_generation), vectors_path(root, old_generation)
    log.warning(
        "store %s: migrating from format 1 (one whole catalog and index per generation) to "
        "segments (a delta per generation); this happens once",
        root,
    )
    base = base_name(generation)
    if _current_schema(old_catalog):
        _link_or_copy(old_catalog, root / base)
    else:
        shutil.copyfile(old_catalog, root / base)
        Catalog(root / base, read_only=False).close()  # applies the schema migrations
    name = f"seg-{generation:06d}-format1.faiss"
    segment = open_flat_file(old_vectors, name, root)
    if not segment.info.count:
        return Migrated(base, [], segment.index.d, {})
    (root / SEGMENT_DIR).mkdir(exist_ok=True)
    _link_or_copy(old_vectors, root / SEGMENT_DIR / name)
    return Migrated(base, [segment.info], segment.index.d, {name: segment})


def _current_schema(path: Path) -> bool:
    """Whether the plain catalog at `path` has exactly this code's schema migrations."""
    from ragkv.store.catalog import schema

    try:
        con = duckdb.connect(str(path), read_only=True)
    except duckdb.Error as exc:
        raise StoreFormatError(f"cannot open catalog {path}: {exc}".splitlines()[0]) from exc
    try:
        row = con.execute("SELECT value FROM meta WHERE key = 'migrations'").fetchone()
    except duckdb.Error:
        row = None
    finally:
        con.close()
    return row is not None and json.loads(row[0]) == [name for name, _ in schema.MIGRATIONS]


def _link_or_copy(source: Path, target: Path) -> None:
    """`target` as a second name of `source` (both immutable from now on), or a copy where the
    file system has no hard links."""
    target.unlink(missing_ok=True)
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)
