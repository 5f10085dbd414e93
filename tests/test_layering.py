"""Import rules: the store is persistence only and never pulls in transformers; the core
modules it relies on stay light."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def imported_modules(folder: str) -> set[str]:
    names = set()
    for path in (ROOT / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
    return names


def test_store_imports_no_model_code():
    imported = imported_modules("store")
    assert not {m for m in imported if m.split(".")[0] in ("transformers", "sentence_transformers", "pipelines", "cli")}
    # errors and keys, and config for where the S3 mirror lives (cache_dir; config imports only errors)
    assert {m for m in imported if m.startswith("ragkv")} <= {"ragkv.errors", "ragkv.keys", "ragkv.config"}


def test_importing_the_store_loads_no_transformers():
    code = "import sys, store, ragkv; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False"


def test_only_ragkv_kv_touches_the_transformers_cache():
    users = [p.relative_to(ROOT).as_posix() for folder in ("ragkv", "pipelines", "store")
             for p in (ROOT / folder).rglob("*.py") if "DynamicCache" in p.read_text()]
    assert users == ["ragkv/kv.py"]
