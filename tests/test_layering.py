"""Import rules: the layers drawn in docs/architecture.md (the one description of them), held
here; no module imports one above it, so there is no import cycle, and the store never pulls
in transformers. `ragkv/__init__.py`, the public facade, imports its layers lazily."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORE = {"ragkv.errors", "ragkv.formats", "ragkv.keys", "ragkv.config", "ragkv.cpu", "ragkv.text", "ragkv.filters"}
MODEL_CODE = {
    f"ragkv.{m}"
    for m in (
        "answer",
        "ape",
        "assemble",
        "attention_probe",
        "blend",
        "codec",
        "decoding",
        "embed",
        "fingerprint",
        "forward",
        "generate",
        "guard",
        "kv",
        "kv_layout",
        "lru",
        "model",
        "prefix_cache",
        "profiles",
        "prompt",
        "rope",
        "self_check",
        "spans",
    )
}
ONLINE_LAYERS = [  # bottom up; a module may import its own layer and those below
    {"ragkv.search"},
    {"ragkv.active", "ragkv.calibration", "ragkv.retrieval", "ragkv.loader", "ragkv.integrations.paged"},
    {"ragkv.rerank"},
    {"ragkv.runtime", "ragkv.integrations.store_match"},
    {"ragkv.conversation"},
    {"ragkv.scheduler", "ragkv.engine", "ragkv.api"},
    {
        "ragkv.query",
        "ragkv.batch",
        "ragkv.output",
        "ragkv.cli_options",
        "ragkv.cli_serve",
        "ragkv.command",
        "ragkv.service",
        "ragkv.vllm_front",
        "ragkv.integrations",
        "ragkv.integrations.adapter",
        "ragkv.integrations.langchain",
        "ragkv.integrations.llama_index",
        "ragkv.integrations.vllm",
        "ragkv.integrations.vllm_fill",
        "ragkv.integrations.vllm_load",
    },
]
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


def under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def top(module: str) -> str:
    return module.split(".")[0]


def test_store_imports_no_model_code_and_only_the_core():
    modules = imported_modules("store")
    assert not offenders(modules, lambda m: top(m) in ("transformers", "sentence_transformers"))
    assert not offenders(modules, lambda m: top(m) == "ragkv" and m not in CORE and not m.startswith("ragkv.store"))


def test_the_core_imports_nothing_above_it():
    modules = {f"ragkv/{m.split('.')[1]}.py": imports_of(ROOT / "ragkv" / f"{m.split('.')[1]}.py") for m in CORE}
    assert not offenders(
        modules,
        lambda m: top(m) == "transformers" or (top(m) == "ragkv" and m not in CORE),
    )


def test_the_online_path_never_imports_pipelines_or_the_cli():
    modules = {p: n for p, n in imported_modules("ragkv", exclude=FACADE).items() if not p.startswith("ragkv/cli/")}
    modules.pop("ragkv/__main__.py")
    assert not offenders(modules, lambda m: under(m, "ragkv.pipelines") or under(m, "ragkv.cli"))


def test_pipelines_never_import_the_cli():
    assert not offenders(imported_modules("pipelines"), lambda m: under(m, "ragkv.cli"))


def test_the_facade_imports_lower_layers_only_lazily():
    tree = ast.parse(FACADE.read_text())
    top_level = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert all(isinstance(n, ast.ImportFrom) and n.module in ("ragkv.errors", "ragkv.formats") for n in top_level)


def test_importing_the_store_loads_no_transformers():
    code = "import sys, store, ragkv; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False"


def test_only_ragkv_kv_touches_the_transformers_cache():
    """kv.py converts to and from the cache; kv_layout.py reads a model's cache to describe it."""
    users = sorted(
        p.relative_to(ROOT).as_posix()
        for folder in ("ragkv", "pipelines", "store")
        for p in (ROOT / folder).rglob("*.py")
        if "DynamicCache" in p.read_text()
    )
    assert users == ["ragkv/kv.py", "ragkv/kv_layout.py"]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def own_imports() -> dict[str, set[str]]:
    """Every module of ragkv (but the facade), store and pipelines, and the modules of those
    three it imports (at the top or inside a function)."""
    paths = {
        module_name(p): p
        for folder in ("ragkv", "store", "pipelines")
        for p in (ROOT / folder).rglob("*.py")
        if p != FACADE and p.parent.name != "cli" and p.name != "__main__.py"
    }
    return {name: {m for m in imports_of(path) if m in paths and m != name} for name, path in paths.items()}


def test_every_ragkv_module_has_a_layer():
    placed = CORE | MODEL_CODE | set().union(*ONLINE_LAYERS)
    modules = {m for m in own_imports() if m.startswith("ragkv")}
    assert modules - placed == set()


def test_nothing_in_ragkv_imports_a_layer_above_it():
    rank = {m: 0 for m in CORE} | {m: 1 for m in MODEL_CODE}
    rank |= {m: 2 + i for i, layer in enumerate(ONLINE_LAYERS) for m in layer}
    graph = own_imports()
    upward = {(m, n) for m, names in graph.items() if m in rank for n in names if n in rank and rank[n] > rank[m]}
    assert upward == set()


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
