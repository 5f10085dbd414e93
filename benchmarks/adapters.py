"""TTFT through the framework adapters against `ragkv.open(...)` itself, in one process, warm,
side by side on the same questions: do the LangChain and LlamaIndex layers cost anything?

    python benchmarks/adapters.py [--store DIR] [--rounds 5]   -> benchmarks/results/adapters.md

The store is the README demo's (the sample corpus, bundled SmolLM2, float32 on CPU); it is
built first if missing. Each round asks every question once per system, in turn (so drift on a
shared machine hits all systems alike); the medians and the ratio to `ragkv.open().stream` are
reported. Answers are checked token for token against `ask` too."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.machine import describe  # noqa: E402

QUESTIONS = [line.strip() for line in (ROOT / "benchmarks" / "questions.txt").read_text().splitlines() if line.strip()]


def first_token_s(chunks) -> float:
    """Seconds from the call to the first non-empty piece of text of an iterator, then drains it."""
    start = time.perf_counter()
    first = None
    for chunk in chunks:
        text = chunk if isinstance(chunk, str) else chunk.content
        if first is None and text:
            first = time.perf_counter() - start
    return first if first is not None else time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--store", type=Path, default=None, help="a demo store to reuse (default: built in a temp folder)"
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "adapters.md"))
    args = parser.parse_args()

    from langchain_core.runnables import RunnablePassthrough

    import ragkv
    from benchmarks.fidelity import work_dir
    from ragkv.integrations.langchain import ChatRagkv, RagkvRetriever, rag_prompt
    from ragkv.integrations.llama_index import RagkvQueryEngine

    store = args.store or work_dir(None, "adapters") / "store"
    if not store.exists():
        ragkv.ingest([ROOT / "data"], store)
    questions = QUESTIONS[:8]
    with ragkv.open(store, device="cpu") as rag:
        llm = ChatRagkv(engine=rag, max_tokens=args.max_tokens)
        chain = {"documents": RagkvRetriever(engine=rag), "question": RunnablePassthrough()} | rag_prompt | llm
        query_engine = RagkvQueryEngine(engine=rag, max_tokens=args.max_tokens, streaming=True)
        expected = {q: rag.ask(q, max_new_tokens=args.max_tokens).token_ids for q in questions}
        same = all(chain.invoke(q).response_metadata["ragkv"]["token_ids"] == expected[q] for q in questions)
        for q in questions:
            streamed = query_engine.query(q)
            "".join(streamed.response_gen)
            same = same and streamed.metadata["ragkv"]["token_ids"] == expected[q]
        systems = {
            "ragkv.open().stream": lambda q: rag.stream(q, max_new_tokens=args.max_tokens),
            "ChatRagkv.stream (retrieves itself)": lambda q: llm.stream(q),
            "retriever \\| rag_prompt \\| ChatRagkv": lambda q: chain.stream(q),
            "LlamaIndex RagkvQueryEngine (streaming)": lambda q: query_engine.query(q).response_gen,
        }
        times: dict[str, list[float]] = {name: [] for name in systems}
        for run in systems.values():  # warm-up: one question each
            first_token_s(run(questions[0]))
        for _ in range(args.rounds):
            for question in questions:
                for name, run in systems.items():
                    times[name].append(first_token_s(run(question)))
    base = statistics.median(times["ragkv.open().stream"])
    lines = [
        "# Framework adapters: TTFT against ragkv.open() in the same process",
        "",
        f"Command: `python benchmarks/adapters.py --rounds {args.rounds}`. Machine: {describe()}.",
        f"Store: the sample corpus (`data/`), bundled SmolLM2 in float32, top_k 1, {len(questions)} questions "
        f"x {args.rounds} rounds, warm (one warm-up question per system), systems in turn within each question. "
        f"Answers through the chain and the query engine equal `ask`'s token for token: "
        f"{'yes' if same else 'NO'}.",
        "",
        "| system | TTFT p50 | p90 | vs ragkv.open() |",
        "|---|---|---|---|",
    ]
    for name, values in times.items():
        p50 = statistics.median(values)
        p90 = statistics.quantiles(values, n=10)[-1]
        lines.append(f"| {name} | {p50 * 1000:.0f} ms | {p90 * 1000:.0f} ms | {p50 / base:.2f}x |")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
