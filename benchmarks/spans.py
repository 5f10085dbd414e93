"""Exact answers over a document's neighbouring chunks: document-continuous KV (`ingest
--span-tokens`, `ask --context span`) against today's `exact` (the first chunk's KV from the
store, the others prefilled live) and against a full prefill, on the same prompts.

Corpus: pages of the Python FAQ from Debian's python3.11-doc package (long documents, fetched
and extracted at run time, never committed); questions: its question headings. Each page is
ingested twice with the bundled SmolLM2 (float32): chunks alone (`--span-tokens 0`) and in
spans. Per question, the prompt holds K neighbouring chunks: the first K chunks of the span
holding the question's best hit (questions whose span has fewer are skipped), in document order,
the very same ids on every path. Reported per K: median time to first token of each path
(assembling the cache + prefilling what it lacks; RAM tier emptied before each, so the KV is
read from the store), the speed-up of spans over `exact` and over a full prefill, greedy
agreement over N tokens with the full prefill, bytes on disk, ingest time.

    python benchmarks/spans.py [--span-tokens 2048] [--chunk-tokens 256] [--questions 24] [--work DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import ragkv  # noqa: E402
from benchmarks.fidelity import python_faq_or_exit, work_dir  # noqa: E402
from benchmarks.machine import describe  # noqa: E402
from benchmarks.passages import cold  # noqa: E402
from ragkv.core.config import AskSettings, DecodeSettings, IngestSettings, ModelSettings  # noqa: E402
from ragkv.model.generate import decode_alone  # noqa: E402

PAGES = ("general.html", "design.html", "library.html", "extending.html")
KS = (2, 3, 5)


def first_token_and_answer(engine, rows, question: str, settings: AskSettings, tokens: int):
    """(seconds to the first token's logits, the greedy answer's token ids) for a prompt over
    `rows`, built through the engine's public seam exactly as `ask` builds it."""
    cold(engine)  # KV read from the store, no earlier prefill reused
    layout, lm = engine.active.layout, engine.lm
    start = time.perf_counter()
    chunk_ids = [engine.chunk_token_ids(r) for r in rows]
    prompt = layout.prompt_ids(chunk_ids, layout.question_ids(lm.tokenizer, question))
    loaded = engine.loader.load(rows, chunk_ids, settings)
    assert not loaded.fallback, loaded.warnings
    assembly = loaded.assembly
    generated = decode_alone(
        lm,
        assembly.cache,
        prompt[assembly.num_cached :],
        tokens,
        assembly.after_prefill,
        DecodeSettings(repetition_penalty=1.0, no_repeat_ngram=0),
        start,
    )
    return generated.first_token_s, generated.token_ids, assembly.num_cached, len(prompt)


def rows_of(engine, doc_id: str, indexes: list[int]):
    catalog = engine.snapshot.catalog
    ids = catalog.documents.chunk_ids_of(doc_id)
    rows = catalog.entries.context_rows(engine.active.profile.profile_id, [ids[i] for i in indexes])
    assert [r.chunk_index for r in rows] == indexes
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--span-tokens", type=int, default=2048)
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--questions", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--work", type=Path, default=None, help="reuse downloads and stores across runs")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "spans.md")
    args = parser.parse_args()
    work = work_dir(args.work, "spans")
    docs, questions = python_faq_or_exit(work, args.questions, PAGES)
    model = ModelSettings(device="cpu", dtype="float32")
    stores, ingest_s = {}, {}
    for name, span in (("chunks", 0), ("spans", args.span_tokens)):
        stores[name] = work / f"store-{name}-{args.chunk_tokens}-{span}"
        started = time.perf_counter()
        report = ragkv.ingest(
            [docs], stores[name], model=model, settings=IngestSettings(chunk_tokens=args.chunk_tokens, span_tokens=span)
        )
        ingest_s[name] = report.compute_s if report.kv_computed else float("nan")
        print(
            f"{name}: {report.kv_computed} entries computed in {time.perf_counter() - started:.0f} s", file=sys.stderr
        )

    results = {
        k: {"exact": [], "span": [], "full": [], "agree_exact": 0, "agree_span": 0, "n": 0, "prompt": []} for k in KS
    }
    with ragkv.open(stores["spans"], device="cpu") as spans, ragkv.open(stores["chunks"], device="cpu") as chunks:
        bytes_on_disk = {
            "spans": spans.snapshot.catalog.reports.kv_bytes(),
            "chunks": chunks.snapshot.catalog.reports.kv_bytes(),
        }
        first_token_and_answer(spans, [spans.retrieve(questions[0])[0][0]], questions[0], AskSettings(), 2)  # warm up
        for question in questions:
            ((hit, _),) = spans.retrieve(question, top_k=1)
            span_rows = spans.widen([(hit, 0.0)], "document")
            for k in KS:
                if len(span_rows) < k:
                    continue
                indexes = [r.chunk_index for r, _ in span_rows[:k]]
                on_spans = [r for r, _ in span_rows[:k]]
                on_chunks = rows_of(chunks, hit.doc_id, indexes)
                assert [r.token_ids for r in on_chunks] == [r.token_ids for r in on_spans]
                span_s, span_ids, cached, prompt = first_token_and_answer(
                    spans, on_spans, question, AskSettings(), args.tokens
                )
                exact_s, exact_ids, _, _ = first_token_and_answer(
                    chunks, on_chunks, question, AskSettings(), args.tokens
                )
                full_s, full_ids, _, _ = first_token_and_answer(
                    chunks, on_chunks, question, AskSettings(use_cache=False), args.tokens
                )
                r = results[k]
                r["span"].append(span_s)
                r["exact"].append(exact_s)
                r["full"].append(full_s)
                r["prompt"].append(prompt)
                r["agree_span"] += span_ids == full_ids
                r["agree_exact"] += exact_ids == full_ids
                r["n"] += 1
            print(f"{question[:60]}: done", file=sys.stderr)
    args.out.write_text(render(results, bytes_on_disk, ingest_s, args, len(questions)))
    print(args.out.read_text())


def render(results, bytes_on_disk, ingest_s, args, asked: int) -> str:
    lines = [
        "# Exact answers over neighbouring chunks: document-continuous KV (spans)",
        "",
        f"Bundled SmolLM2-135M-Instruct, float32, on {describe()}, {torch.get_num_threads()} threads. Corpus: "
        f"{len(PAGES)} pages of the Python FAQ (python3.11-doc), --chunk-tokens {args.chunk_tokens}, ingested twice: "
        f"each chunk alone, and in spans of --span-tokens {args.span_tokens}. {asked} FAQ question headings; each "
        "prompt holds the first K chunks of the span holding the question's best hit (the same token ids on every "
        f"path). Greedy, {args.tokens} new tokens. Time to first token: assembling the cache (KV read from the "
        "store, RAM tier emptied) and prefilling what it lacks. Command: `python benchmarks/spans.py`.",
        "",
        "- `exact (chunks)`: today's exact mode on the chunk store: the first chunk's KV from the store, the other "
        "K-1 chunks prefilled live;",
        "- `span`: `--context span` on the span store: all K chunks' KV from the store, only the question prefilled;",
        "- `full`: a full prefill of the same prompt.",
        "",
        "| K | prompts | median prompt tokens | TTFT full s | TTFT exact (chunks) s | TTFT span s | span vs exact | "
        "span vs full | answers = full: exact | answers = full: span |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for k, r in results.items():
        if not r["n"]:
            lines.append(f"| {k} | 0 | - | - | - | - | - | - | - | - |")
            continue
        full, exact, span = (statistics.median(r[p]) for p in ("full", "exact", "span"))
        lines.append(
            f"| {k} | {r['n']} | {statistics.median(r['prompt']):.0f} | {full:.3f} | {exact:.3f} | "
            f"{span:.3f} | {exact / span:.1f}x faster | {full / span:.1f}x faster | "
            f"{r['agree_exact']}/{r['n']} | {r['agree_span']}/{r['n']} |"
        )
    ratio = bytes_on_disk["spans"] / bytes_on_disk["chunks"]
    lines += [
        "",
        f"Bytes on disk: spans {bytes_on_disk['spans'] / 2**20:.1f} MiB, chunks alone "
        f"{bytes_on_disk['chunks'] / 2**20:.1f} MiB ({ratio:.3f}x: a span's later chunks also hold the separator "
        f"before them). KV compute at ingest: spans {ingest_s['spans']:.0f} s, chunks alone {ingest_s['chunks']:.0f} s "
        f"({ingest_s['spans'] / ingest_s['chunks']:.2f}x: a span is one longer sequence, and attention grows with it).",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
