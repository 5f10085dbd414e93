"""The package as a user meets it: its version, the formats it writes and refuses, and the
extras it names when one is missing. (The installed wheel itself: tests/test_wheel.py.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import ragkv
from ragkv.core.formats import STORE_FORMAT
from ragkv.core.install import forget_removed_installs
from ragkv.store import open_snapshot
from ragkv.store.generations import manifest_path, read_current
from tests.conftest import ROOT, run_cli


def test_version_is_the_packages_and_loads_no_model_or_store():
    code = (
        "import sys; sys.argv = ['ragkv', '--version']; from ragkv.cli import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('torch', 'transformers', 'duckdb', 'ragkv.store') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert out.splitlines() == [f"ragkv {ragkv.__version__} (store format {STORE_FORMAT})", "[]"]


def test_the_changelog_names_this_version():
    assert f"## {ragkv.__version__}" in (ROOT / "CHANGELOG.md").read_text()


def test_a_store_records_which_ragkv_wrote_it(tiny_store):
    stats = json.loads(run_cli("stats", "--store", tiny_store, "--json").stdout)
    assert stats["written_by"] == ragkv.__version__
    assert f"written by ragkv {ragkv.__version__}" in run_cli("stats", "--store", tiny_store).stdout


def test_a_newer_ragkvs_store_is_refused_naming_both_versions(tiny_store, tmp_path):
    import shutil

    store = tmp_path / "store"
    shutil.copytree(tiny_store, store)
    manifest = manifest_path(store, read_current(store))
    record = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**record, "format": STORE_FORMAT + 1, "written_by": "9.0.0"}))
    result = run_cli("stats", "--store", store)
    assert result.exit_code == 4
    message = result.stderr.strip()
    assert len(message.splitlines()) == 1
    assert "ragkv 9.0.0" in message and f"ragkv {ragkv.__version__}" in message and "upgrade ragkv" in message
    with pytest.raises(ragkv.StoreFormatError):
        open_snapshot(store)


@pytest.mark.parametrize(
    ("module", "hidden", "extra"),
    [
        ("ragkv.integrations.langchain", "langchain_core", "langchain"),
        ("ragkv.integrations.llama_index", "llama_index", "llama-index"),
    ],
)
def test_an_adapter_without_its_extra_names_the_install(module, hidden, extra):
    # The extra's package made unimportable, as on a machine without it.
    code = (
        f"import sys; sys.modules[{hidden!r}] = None\n"
        f"try:\n    import {module}\nexcept ImportError as exc:\n"
        "    from ragkv.core.errors import InputError\n"
        "    print(isinstance(exc, InputError), exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert (
        out.strip() == f"True {module} needs ragkv's '{extra}' extra ({hidden} is not installed): "
        f"pip install 'ragkv[{extra}]'"
    )


def test_ingest_with_ray_missing_says_which_extra(tiny_llama, corpus, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    result = run_cli("ingest", corpus, "--store", tmp_path / "store", "--model", tiny_llama, "--engine", "ray")
    assert result.exit_code == 2
    assert (
        result.stderr.strip() == "error: --engine ray needs ragkv's 'ray' extra (ray is not installed): "
        "pip install 'ragkv[ray]'"
    )
    assert not (tmp_path / "store" / "CURRENT").exists()


def test_the_import_paths_of_removed_installs_are_forgotten(tmp_path):
    """An installed ragkv links itself into `import-path-<version>-<install>` under the cache
    (for vLLM's Python); once that install is deleted, the next new link removes its folder,
    and keeps those of installs still there and one being made."""
    install = tmp_path / "site-packages" / "ragkv"
    install.mkdir(parents=True)
    folders = {name: tmp_path / "cache" / f"import-path-0.2.0-{name}" for name in ("gone", "kept", "making")}
    for folder in folders.values():
        folder.mkdir(parents=True)
    (folders["gone"] / "ragkv").symlink_to(tmp_path / "deleted-venv" / "ragkv", target_is_directory=True)
    (folders["kept"] / "ragkv").symlink_to(install, target_is_directory=True)
    assert forget_removed_installs(tmp_path / "cache") == [folders["gone"]]
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [folders["kept"].name, folders["making"].name]
    assert (folders["kept"] / "ragkv").resolve() == install
