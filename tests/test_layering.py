"""The house's rules, stated about folders: every module of ragkv sits in a layer package, a
package imports only itself and the packages below it (so there is no import cycle), the store
never pulls in a model library, and no folder or module outgrows what a reader can take in.
docs/architecture.md draws the same layers. `ragkv/__init__.py`, the public facade, imports
its layers lazily; `ragkv/__main__.py` is `python -m ragkv`.

ragkv/store and ragkv/pipelines are links to the repository's top-level store/ and pipelines/
(the wheel holds their files inside ragkv), so walking ragkv/ follows them."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "ragkv"
LAYERS = [  # bottom up: a module imports its own package and the packages below it
    "ragkv.core",  # errors, formats, keys, settings, filters: what every layer may use
    "ragkv.store",  # persistence only: imports the core and no model library
    "ragkv.kv",
    "ragkv.model",
    "ragkv.modes",
    "ragkv.loading",
    "ragkv.retrieval",
    "ragkv.engine",
    "ragkv.pipelines",  # the offline jobs: only the command line imports them
    "ragkv.integrations",
    "ragkv.serve",
    "ragkv.cli",
]
ENTRIES = {"ragkv", "ragkv.__main__"}  # the facade and `python -m ragkv`, above every layer
MAX_MODULES_PER_FOLDER = 12
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def modules() -> dict[str, Path]:
    """Every module of the installed package, by dotted name, the links followed."""
    found = {}
    for folder, dirs, files in os.walk(PACKAGE, followlinks=True):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            if name.endswith(".py"):
                parts = Path(folder, name).relative_to(ROOT).with_suffix("").parts
                found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = Path(folder, name)
    return found


def imports_of(path: Path) -> set[str]:
    """The modules `path` imports, at the top or inside a function; `from P import m` counts as
    importing P.m where m is a module."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def own_imports() -> dict[str, set[str]]:
    paths = modules()
    return {name: {m for m in imports_of(path) if m in paths and m != name} for name, path in paths.items()}


def layer_of(module: str) -> int | None:
    return next((i for i, layer in enumerate(LAYERS) if module == layer or module.startswith(layer + ".")), None)


def test_every_module_sits_in_a_layer_package():
    assert {m for m in modules() if m not in ENTRIES and layer_of(m) is None} == set()


def test_no_module_imports_a_layer_above_its_own():
    upward = {
        (m, n)
        for m, names in own_imports().items()
        if m not in ENTRIES
        for n in names
        if n not in ENTRIES and layer_of(n) > layer_of(m)
    }
    assert upward == set()


def test_the_fronts_reach_the_engine_retrieval_and_loading_through_one_module():
    """ragkv.serve.stores, the store handle every route goes through, is the only module of the
    service that imports the layers that answer (the routes hold no engine)."""
    below = ("ragkv.engine", "ragkv.loading", "ragkv.retrieval")
    importers = {
        m
        for m, names in own_imports().items()
        if m.startswith("ragkv.serve.") and any(n.startswith(below) for n in names)
    }
    assert importers == {"ragkv.serve.stores"}


def test_only_the_command_line_imports_the_pipelines():
    importers = {
        m for m, names in own_imports().items() for n in names if layer_of(n) == LAYERS.index("ragkv.pipelines")
    }
    assert {
        m
        for m in importers
        if m not in ENTRIES and layer_of(m) not in (LAYERS.index("ragkv.pipelines"), LAYERS.index("ragkv.cli"))
    } == set()


def test_the_store_and_the_core_load_no_model_library():
    for layer in ("ragkv.core", "ragkv.store"):
        for name, path in modules().items():
            if layer_of(name) == LAYERS.index(layer):
                assert not {m for m in imports_of(path) if m.split(".")[0] in ("transformers", "sentence_transformers")}


def test_importing_the_store_loads_no_transformers():
    code = "import sys, ragkv.store; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False"


def test_the_facade_imports_lower_layers_only_lazily():
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    top_level = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert all(
        isinstance(n, ast.ImportFrom) and n.module in ("ragkv.core.errors", "ragkv.core.formats") for n in top_level
    )


def test_only_ragkv_kv_touches_the_transformers_cache():
    """kv.cache converts to and from the cache, kv.ragged batches it, kv.layout reads a model's
    cache, kv.movable the layer kinds a config's cache would have."""
    users = sorted(name for name, path in modules().items() if "DynamicCache" in path.read_text())
    assert users == ["ragkv.kv.cache", "ragkv.kv.layout", "ragkv.kv.movable", "ragkv.kv.ragged"]


def test_there_is_no_import_cycle():
    graph = own_imports()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def cycle_from(module: str, path: list[str]) -> list[str] | None:
        state[module] = 1
        for name in sorted(graph[module]):
            if state.get(name) == 1:
                return path + [module, name]
            if name not in state and (found := cycle_from(name, path + [module])):
                return found
        state[module] = 2
        return None

    cycles = [c for m in sorted(graph) if m not in state and (c := cycle_from(m, []))]
    assert cycles == []


def test_no_folder_holds_more_than_twelve_modules():
    per_folder: dict[Path, int] = {}
    for path in modules().values():
        if path.name != "__init__.py":
            per_folder[path.parent] = per_folder.get(path.parent, 0) + 1
    crowded = {folder.relative_to(ROOT).as_posix(): n for folder, n in per_folder.items() if n > MAX_MODULES_PER_FOLDER}
    assert crowded == {}


def sizes() -> tuple[dict[str, int], dict[str, int]]:
    """The modules over MAX_MODULE_LINES and the functions over MAX_FUNCTION_LINES, by length."""
    long_modules, long_functions = {}, {}
    for name, path in modules().items():
        text = path.read_text()
        if (lines := text.count("\n")) > MAX_MODULE_LINES:
            long_modules[name] = lines
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long_functions[f"{name}.{node.name}"] = length
    return long_modules, long_functions


def test_no_module_or_function_outgrows_a_reading():
    assert sizes() == ({}, {})
