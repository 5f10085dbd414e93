"""`ragkv eval` on the sample corpus: the 48 questions of benchmarks/retrieval_sample.jsonl (each
naming the documents that answer it) over a store of data/ built with the defaults, each
retrieval setting side by side; writes benchmarks/results/eval_sample.md and .png.

    python benchmarks/eval_sample.py [--store ./kvstore] [SETTING ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.machine import describe  # noqa: E402

SETTINGS = ["dense", "lexical", "hybrid", "hybrid --rerank 10"]
QUESTIONS = ROOT / "benchmarks" / "retrieval_sample.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("settings", nargs="*", default=SETTINGS)
    parser.add_argument("--store", type=Path, default=None, help="a store of data/ (default: built in a temp folder)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "eval_sample.md")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        store = args.store or Path(tmp) / "store"
        if args.store is None:
            command = [sys.executable, "-m", "ragkv", "ingest", str(ROOT / "data"), "--store", str(store), "--quiet"]
            subprocess.run(command, cwd=ROOT, check=True, capture_output=True)
        command = [sys.executable, "-m", "ragkv", "eval", str(QUESTIONS), *args.settings, "--store", str(store)]
        report = json.loads(_run([*command, "--json", "--plot", str(args.out.with_suffix(".png"))]))
        table = _run(command)
    settings = " ".join(f"'{s}'" for s in args.settings)
    text = "\n".join(
        [
            f"`ragkv eval benchmarks/retrieval_sample.jsonl {settings}` over a store of `data/` built with the "
            f"defaults (bundled SmolLM2-135M and all-MiniLM-L6-v2), {time.strftime('%Y-%m-%d')}; "
            f"{report['questions']} questions. Machine: {describe()}. Plot: `eval_sample.png`.",
            "",
            "```",
            table.rstrip(),
            "```",
            "",
        ]
    )
    args.out.write_text(text)
    print(text)


def _run(command: list[str]) -> str:
    return subprocess.run(command, cwd=ROOT, check=True, capture_output=True, text=True).stdout


if __name__ == "__main__":
    main()
