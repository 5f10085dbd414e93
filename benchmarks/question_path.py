"""The path of a question: the stack of ragkv's own frames when `ragkv ask`'s retrieval starts,
from the command's function to the first call into the retriever (`prompt_for`), for each source
tree given, in a fresh process each. Not a timing: a count of hops, for docs/architecture.md.

    python benchmarks/question_path.py STORE TREE [TREE ...] [--out FILE]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Runs in a fresh python whose sys.path starts with the tree measured.
WORKER = r"""
import sys, traceback
from pathlib import Path
tree, store = sys.argv[1], sys.argv[2]
sys.path.insert(0, tree)
found = []
def watch(frame, event, arg):
    if event == "call" and not found and frame.f_code.co_name == "prompt_for" and "retriev" in frame.f_code.co_filename:
        found.append(traceback.extract_stack(frame))
from typer.testing import CliRunner
if Path(tree, "ragkv", "cli").is_dir():
    from ragkv.cli import app
else:  # a tree from before the layer packages
    from cli import app
sys.setprofile(watch)
CliRunner().invoke(app, ["ask", "How do I rotate the API key?", "--store", store, "--max-new-tokens", "2"])
sys.setprofile(None)
(stack,) = found
names = [f.name for f in stack]
stack = stack[names.index("ask"):]
for f in stack:
    print(f"{Path(f.filename).resolve().relative_to(Path(tree).resolve())} {f.name}")
"""


def path_of(tree: Path, store: Path) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", WORKER, str(tree), str(store)], capture_output=True, text=True, cwd=tree
    )
    if out.returncode:
        raise SystemExit(f"{tree}: {out.stderr[-2000:]}")
    return out.stdout.split("\n")[:-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("store", type=Path)
    parser.add_argument("trees", type=Path, nargs="+")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "question_path.md")
    args = parser.parse_args()
    lines = ["# The path of a question: `ragkv ask`'s frames from the command to the retriever", ""]
    for tree in args.trees:
        frames = path_of(tree, args.store)
        commit = subprocess.run(
            ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        )
        modules = {f.split()[0] for f in frames[:-1]}
        lines += [
            f"## {commit.stdout.strip()}: {len(frames) - 1} calls across {len(modules)} modules before the retriever",
            "",
            *[f"{i}. `{f}`" for i, f in enumerate(frames, 1)],
            "",
        ]
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
