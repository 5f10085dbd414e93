"""Throughput of `ragkv batch` against asking the same questions one by one, side by side in
one run, on the bundled SmolLM2 and the sample corpus; and that every batched answer equals
its single-question answer.

    python benchmarks/batch_throughput.py [--tokens 24] [--max-batch 16]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.machine import describe  # noqa: E402

import ragkv  # noqa: E402
from ragkv.batch import Question, answer_all  # noqa: E402
from ragkv.config import AskSettings, ModelSettings  # noqa: E402

# Several phrasings per topic: a RAG service sees the same documents asked about many ways.
TOPICS = {
    "API key": ["How do I rotate the API key?", "When must the API key be rotated?", "What if the API key leaked?",
                "Where is a new API key stored?"],
    "leave": ["How many days of annual leave do I get?", "Who approves my leave?", "How much leave carries over?",
              "Do sick days count against leave?"],
    "deploy": ["How do we deploy to production?", "Can I deploy on Friday?", "What is a canary release?",
               "Which tool syncs production deploys?"],
    "backups": ["How long are backups kept?", "How do I restore the database to a point in time?",
                "When does the restore drill run?", "Where are write-ahead logs archived?"],
    "on-call": ["How much is an on-call week paid?", "How fast must I acknowledge a page?",
                "Who do I escalate to when on call?", "What goes in the on-call handover?"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "batch.md")
    args = parser.parse_args()
    questions = [q for qs in TOPICS.values() for q in qs]
    settings = AskSettings(max_new_tokens=args.tokens)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in ("float32", "bfloat16"):
            store = Path(tmp) / dtype
            ragkv.ingest([ROOT / "data"], store, model=ModelSettings(device="cpu", dtype=dtype))
            with ragkv.open(store, device="cpu") as engine:
                engine.ask(questions[0], max_new_tokens=2)  # warm up
                start = time.perf_counter()
                alone = [engine.ask(q, settings) for q in questions]
                alone_s = time.perf_counter() - start
                start = time.perf_counter()
                outcomes = list(answer_all(engine, [Question(str(i), q) for i, q in enumerate(questions)], settings,
                                           max_batch=args.max_batch))
                batch_s = time.perf_counter() - start
                by_id = {o.question.id: o.answer for o in outcomes}
                same = sum(by_id[str(i)].token_ids == a.token_ids for i, a in enumerate(alone))
                groups = len({tuple(s.chunk_id for s in o.answer.sources) for o in outcomes})
                rows.append((dtype, len(questions), groups, len(questions) / alone_s, len(questions) / batch_s, same))
            print(f"{dtype}: done", file=sys.stderr)
    lines = [
        "# Batches grouped by shared context vs one question at a time",
        "",
        f"Bundled SmolLM2-135M-Instruct on the sample corpus, CPU ({describe()}, {torch.get_num_threads()} "
        f"threads, torch {torch.__version__}); {len(questions)} questions ({len(TOPICS)} topics, 4 phrasings each), "
        f"top-1, greedy, {args.tokens} new tokens, --max-batch {args.max_batch}. Both runs in one process, warm. "
        "Command: `python benchmarks/batch_throughput.py`.",
        "",
        "| dtype | questions | context groups | one by one (questions/s) | batched (questions/s) | speed-up | batched answer = alone |",
        "|---|---|---|---|---|---|---|",
    ]
    for dtype, n, groups, alone_qps, batch_qps, same in rows:
        lines.append(f"| {dtype} | {n} | {groups} | {alone_qps:.2f} | {batch_qps:.2f} | {batch_qps / alone_qps:.2f}× | "
                     f"{same}/{n} |")
    lines += ["", "float32 answers must all be equal (a test holds this); in bfloat16 a batched prefill rounds "
              "differently from a lone one, so equality is measured, not promised.", ""]
    args.out.write_text("\n".join(lines))
    print(args.out.read_text())


if __name__ == "__main__":
    main()
