"""Import rules. Imports flow one way:

    cli  ->  pipelines  ->  ragkv (the online path and model code)  ->  store  ->  ragkv core

`ragkv/__init__.py` is the public facade (`ragkv.open`, `ragkv.ingest`): it imports the
layers below it lazily, inside its functions, and is the one module exempt. The core
(errors, keys, config, cpu) imports nothing else of ragkv's; the store never pulls in
transformers."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORE = {"ragkv.errors", "ragkv.keys", "ragkv.config", "ragkv.cpu", "ragkv.text"}
FACADE = ROOT / "ragkv" / "__init__.py"


def imports_of(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names if node.module == "ragkv")
    return names


def imported_modules(folder: str, exclude: Path | None = None) -> dict[str, set[str]]:
    return {p.relative_to(ROOT).as_posix(): imports_of(p) for p in (ROOT / folder).rglob("*.py") if p != exclude}


def offenders(modules: dict[str, set[str]], forbidden) -> dict[str, set[str]]:
    found = {path: {m for m in names if forbidden(m)} for path, names in modules.items()}
    return {path: names for path, names in found.items() if names}


def top(module: str) -> str:
    return module.split(".")[0]


def test_store_imports_no_model_code_and_only_the_core():
    modules = imported_modules("store")
    assert not offenders(modules, lambda m: top(m) in ("transformers", "sentence_transformers", "pipelines",
                                                       "cli"))
    assert not offenders(modules, lambda m: top(m) == "ragkv" and m not in CORE and m != "ragkv")


def test_the_core_imports_nothing_above_it():
    modules = {f"ragkv/{m.split('.')[1]}.py": imports_of(ROOT / "ragkv" / f"{m.split('.')[1]}.py") for m in CORE}
    assert not offenders(modules, lambda m: top(m) in ("store", "pipelines", "cli", "transformers")
                         or (top(m) == "ragkv" and m not in CORE))


def test_the_online_path_never_imports_pipelines_or_the_cli():
    modules = imported_modules("ragkv", exclude=FACADE)
    assert not offenders(modules, lambda m: top(m) in ("pipelines", "cli"))


def test_pipelines_never_import_the_cli():
    assert not offenders(imported_modules("pipelines"), lambda m: top(m) == "cli")


def test_the_facade_imports_lower_layers_only_lazily():
    tree = ast.parse(FACADE.read_text())
    top_level = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert all(isinstance(n, ast.ImportFrom) and n.module == "ragkv.errors" for n in top_level)


def test_importing_the_store_loads_no_transformers():
    code = "import sys, store, ragkv; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False"


def test_only_ragkv_kv_touches_the_transformers_cache():
    users = [p.relative_to(ROOT).as_posix() for folder in ("ragkv", "pipelines", "store")
             for p in (ROOT / folder).rglob("*.py") if "DynamicCache" in p.read_text()]
    assert users == ["ragkv/kv.py"]
