"""Where this ragkv is installed, as another Python must see it: vLLM pins its own torch and
transformers, so it runs in an environment of its own and imports ragkv's connector from a
folder put on its PYTHONPATH. Both the serve front (ragkv.serve.vllm_front) and the vLLM
ingest engine (ragkv.pipelines.engines.vllm_engine) start such a Python, so this sits below
both of them."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from ragkv.core.config import cache_dir
from ragkv.core.formats import __version__


def import_path() -> str:
    """A folder that holds ragkv and nothing else, for another Python's PYTHONPATH (vLLM pins its
    own torch and transformers, so it runs in its own environment and imports the connector from
    here). A checkout is such a folder; an installed ragkv lives in a site-packages whose torch
    must not shadow vLLM's, so it is linked into a folder of its own under the cache. One link:
    ragkv.store and ragkv.pipelines are inside the package."""
    package = next(p for p in Path(__file__).resolve().parents if p.name == "ragkv")
    here = package.parent
    if (here / "pyproject.toml").exists():  # a checkout (or an editable install of one)
        return str(here)
    where = hashlib.blake2b(str(here).encode(), digest_size=4).hexdigest()  # one folder per install
    folder = cache_dir() / f"import-path-{__version__}-{where}"
    link = folder / "ragkv"
    if link.resolve() != package:
        forget_removed_installs(cache_dir())
        folder.mkdir(parents=True, exist_ok=True)
        scratch = folder / f".ragkv.{os.getpid()}"
        scratch.unlink(missing_ok=True)
        scratch.symlink_to(package, target_is_directory=True)
        os.replace(scratch, link)  # atomic: a concurrent start sees the old link or the new one
    return str(folder)


def forget_removed_installs(cache: Path) -> list[Path]:
    """Remove the import-path folders under `cache` whose install is gone (its link points
    nowhere): each wheel installed into a virtual environment deleted since left one behind.
    A folder whose install is still there, or that another start is making (no link yet),
    stays. Returns the folders removed."""
    removed = []
    for folder in sorted(cache.glob("import-path-*")):
        link = folder / "ragkv"
        if link.is_symlink() and not link.exists():
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed
