"""Fingerprints of model folders: blake2b over config and weight files, computed once per
file set and cached by path, size and mtime (hashing 500 MB of weights takes about a second)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from ragkv.core.config import cache_dir
from ragkv.core.errors import ModelError
from ragkv.core.keys import digest, file_digest

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def folder_fingerprint(folder: Path) -> str:
    """blake2b of `config.json` and the weight files directly in `folder`, cached."""
    folder = Path(folder)
    weights = sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    if not weights:
        raise ModelError(f"model folder {folder} has no weight files (*.safetensors or *.bin)")
    files = [p for p in [folder / "config.json"] if p.is_file()] + weights
    signature = digest(*(f"{p.resolve()}|{p.stat().st_size}|{p.stat().st_mtime_ns}" for p in files))
    cache_file = cache_dir() / "fingerprints.json"
    cached = _read_json(cache_file)
    if signature not in cached:
        cached[signature] = file_digest(files)
        _write_json_atomic(cache_file, cached)
    return cached[signature]


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _write_json_atomic(path: Path, value: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(value, f)
    os.replace(tmp, path)
