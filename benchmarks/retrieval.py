"""Does the right passage come first? Retrieval quality per first stage, with and without the
rerank that reads the stored KV, and what each costs beside a cached answer.

Sets (benchmarks/retrieval_sets.py): the sample corpus's questions, the Python FAQ and the
Debian FAQ; each FAQ entry is a document holding its answer, its heading is the question. Each
set is ingested with the bundled SmolLM2 (float32), as `ragkv ingest` does by default.

First stages, DEPTH candidates each, all ragkv's own (`QueryEngine.search`):
- dense: all-MiniLM-L6-v2, cosine;
- lexical: BM25 over the store's lexical index (ragkv.store.index.lexical);
- hybrid: the two fused by ragkv.retrieval.search.fuse, the lexical list weighted w.
Rerank: the first N candidates (N = 5, 10, 20) scored by ragkv.retrieval.rerank, fused with the first
stage's score weighted f:
- likelihood: the question's mean log-probability after each candidate's stored KV (one row
  per candidate), under each instruction wording;
- attention: ICR, the attention mass the question puts on each candidate when all N are
  placed in one cache (one forward; its pool depends on N and the first stage, so it is
  scored per configuration, with hybrid at the lexical weight chosen first);
- both: the two z-scores summed.
Every weight is chosen on the dev halves of the sets (pooled: the mean of each set's MRR@10)
and every number is reported on the test halves, with 95% bootstrap intervals over the test
questions (2000 resamples). A question counts as found at rank r when the chunk at r belongs
to one of its relevant documents.

Latency (the sample set, warm, this process, the first LATENCY_QUESTIONS questions): each
first stage's retrieval time and the rerank's added time at each N, beside a cached answer's
TTFT (`ask`, top-1, one token), p50 and p90.

    python benchmarks/retrieval.py [--work DIR] [--sets sample,python-faq,debian-faq]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import ragkv  # noqa: E402
from benchmarks.approximate import bootstrap  # noqa: E402
from benchmarks.fidelity import work_dir  # noqa: E402
from benchmarks.machine import describe  # noqa: E402
from benchmarks.retrieval_sets import Question, build, split  # noqa: E402
from ragkv.core.config import ModelSettings  # noqa: E402
from ragkv.retrieval import rerank as reranking  # noqa: E402
from ragkv.retrieval import search as first_stages  # noqa: E402
from ragkv.store import Hit  # noqa: E402

SETS = ("sample", "python-faq", "debian-faq")
DEPTH = first_stages.FUSION_DEPTH
NS = (5, 10, 20)
LEXICAL_WEIGHTS = tuple(round(0.1 * i, 1) for i in range(11))
FIRST_WEIGHTS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0)
INSTRUCTIONS = {  # the text between a candidate and the question scored
    "answer prompt": "",  # the answer's own question head: "\n\nQuestion: "
    "UPR": "\n\nPlease write a question based on this passage.\nQuestion: ",  # Sachan et al. 2022
}
SCORERS = {  # label -> Candidates.ranking's scorer options
    **{f"likelihood, {name} wording": {"instruction": name, "score": "likelihood"} for name in INSTRUCTIONS},
    "attention (ICR)": {"instruction": "answer prompt", "score": "attention"},
    "both": {"instruction": "answer prompt", "score": "both"},
}
LATENCY_QUESTIONS = 30
OUT = ROOT / "benchmarks" / "results" / "retrieval.md"


@dataclass
class Candidates:
    """One question's first-stage lists (best first) and every listed chunk's document and
    model scores (per instruction)."""

    question: Question
    dense: list[Hit]
    lexical: list[Hit]
    doc_of: dict[int, str]
    likelihood: dict[str, dict[int, float]] = field(default_factory=dict)  # wording -> chunk -> score
    attention: dict[tuple[str, int], dict[int, float]] = field(default_factory=dict)  # (stage, N) -> chunk -> score

    def first(self, stage: str, lexical_weight: float) -> list[Hit]:
        if stage == "hybrid":
            return first_stages.fuse(self.dense, self.lexical, lexical_weight)[:DEPTH]
        return self.dense if stage == "dense" else self.lexical

    def ranking(
        self, stage: str, lexical_weight: float, rerank: int = 0, instruction: str = "", weight=0.0, score="likelihood"
    ):
        """Document ids in the order a configuration puts the chunks."""
        first = self.first(stage, lexical_weight)
        if rerank:
            pool, rest = first[:rerank], first[rerank:]
            model = self.model_scores(pool, stage, rerank, instruction, score)
            scores = reranking.fuse(model, [h.score for h in pool], weight)
            first = [pool[i] for i in sorted(range(len(pool)), key=lambda i: -scores[i])] + rest
        return [self.doc_of[h.chunk_id] for h in first]

    def model_scores(self, pool: list[Hit], stage: str, rerank: int, instruction: str, score: str) -> list[float]:
        likelihood = [self.likelihood[instruction][h.chunk_id] for h in pool]
        if score == "likelihood":
            return likelihood
        attention = [self.attention[(stage, rerank)][h.chunk_id] for h in pool]
        if score == "attention":
            return attention
        return [
            a + b for a, b in zip(reranking.standardised(likelihood), reranking.standardised(attention), strict=True)
        ]


def score_attention(engine, candidates: Candidates, lexical_weight: float) -> None:
    """ICR attention scores for each (stage, N) pool of one question."""
    runtime = engine.runtime
    reranker = reranking.KVReranker(runtime.loader, runtime.retriever, 0.0, score="attention")
    for stage in ("dense", "hybrid"):
        for n in NS:
            pool = candidates.first(stage, lexical_weight)[:n]
            rows = runtime.retriever.rows([Hit(h.chunk_id, 0.0) for h in pool])
            reranked = engine.engine.call(reranker.rerank, candidates.question.question, rows)
            candidates.attention[(stage, n)] = {s.row.chunk_id: s.model_score for s in reranked.scored}


def candidates_of(engine, question: Question, rerankers: dict) -> Candidates:
    dense = list(engine.search(question.question, top_k=DEPTH, retrieval="dense"))
    lexical_found = engine.search(question.question, top_k=DEPTH, retrieval="lexical")
    lexical = list(lexical_found) if lexical_found.retrieval == "lexical" else []
    as_hits = [Hit(r.chunk_id, r.score) for r in dense], [Hit(r.chunk_id, r.score) for r in lexical]
    listed = list(dict.fromkeys(h.chunk_id for h in as_hits[0] + as_hits[1]))
    runtime = engine.runtime
    rows = runtime.retriever.rows([Hit(c, 0.0) for c in listed])
    found = Candidates(question, *as_hits, {row.chunk_id: row.doc_id for row, _ in rows})
    for name, reranker in rerankers.items():
        reranked = engine.engine.call(reranker.rerank, question.question, rows)
        found.likelihood[name] = {s.row.chunk_id: s.model_score for s in reranked.scored}
    return found


def metrics(rankings: list[tuple[list[str], Question]]) -> dict[str, tuple[float, float, float]]:
    found1 = [float(bool(r) and r[0] in q.relevant) for r, q in rankings]
    found5 = [float(any(d in q.relevant for d in r[:5])) for r, q in rankings]
    mrr = [next((1.0 / (i + 1) for i, d in enumerate(r[:10]) if d in q.relevant), 0.0) for r, q in rankings]
    return {"recall@1": bootstrap(found1), "recall@5": bootstrap(found5), "mrr@10": bootstrap(mrr)}


def mrr(candidates: list[Candidates], **config) -> float:
    return metrics([(c.ranking(**config), c.question) for c in candidates])["mrr@10"][0]


def halves(candidates: list[Candidates]) -> tuple[list[Candidates], list[Candidates]]:
    by_id = {c.question.qid: c for c in candidates}
    dev, test = split([c.question for c in candidates])
    return [by_id[q.qid] for q in dev], [by_id[q.qid] for q in test]


def _pooled(dev: dict[str, list[Candidates]], **config) -> float:
    return statistics.fmean(mrr(c, **config) for c in dev.values())


def choose_lexical_weight(dev: dict[str, list[Candidates]]) -> float:
    """Hybrid's lexical weight, by the mean of the sets' dev MRR@10."""
    return max(LEXICAL_WEIGHTS, key=lambda w: _pooled(dev, stage="hybrid", lexical_weight=w))


def choose_first_weights(dev: dict[str, list[Candidates]], lexical: float) -> dict[str, float]:
    """Each scorer's (and likelihood wording's) first-stage weight for the rerank, over every
    stage and N, by the mean of the sets' dev MRR@10."""

    def best(**config) -> float:
        return max(
            FIRST_WEIGHTS,
            key=lambda f: statistics.fmean(
                _pooled(dev, stage=s, lexical_weight=lexical, rerank=n, weight=f, **config)
                for s in ("dense", "hybrid")
                for n in NS
            ),
        )

    return {label: best(**config) for label, config in SCORERS.items()}


def evaluate(test: list[Candidates], weights: dict) -> list[dict]:
    rows = []
    lexical = weights["lexical_weight"]
    for stage in ("dense", "lexical", "hybrid"):
        rows.append({"stage": stage, "rerank": 0, "scorer": "", **_found(test, stage, lexical)})
        if stage == "lexical":
            continue
        for n in NS:
            for label, config in SCORERS.items():
                options = {"rerank": n, "weight": weights["first_weight"][label], **config}
                rows.append({"stage": stage, "rerank": n, "scorer": label, **_found(test, stage, lexical, **options)})
    return rows


def _found(test: list[Candidates], stage: str, lexical_weight: float, **config) -> dict:
    return metrics([(c.ranking(stage, lexical_weight, **config), c.question) for c in test])


def latency(engine, questions: list[Question]) -> dict[str, tuple[float, float]]:
    """p50 and p90 ms, warm: each first stage's retrieval time, the rerank's time at each N (over
    hybrid), and a cached answer's TTFT."""
    engine.ask(questions[0].question, max_new_tokens=1)  # warm up
    times: dict[str, list[float]] = {}

    def note(name: str, ms: float) -> None:
        times.setdefault(name, []).append(ms)

    runtime = engine.runtime
    scorers = {
        "likelihood": reranking.KVReranker(runtime.loader, runtime.retriever, 0.0),
        "attention": reranking.KVReranker(runtime.loader, runtime.retriever, 0.0, score="attention"),
    }
    for q in questions:
        for stage in ("dense", "lexical", "hybrid"):
            answer = engine.ask(q.question, top_k=1, retrieval=stage, max_new_tokens=1)
            note(f"retrieval, {stage}", answer.stats.retrieval_ms)
            if stage == "dense":
                note("TTFT, dense, no rerank", answer.stats.ttft_s * 1000.0)
        for n in NS:
            rows = runtime.retriever.rows(list(engine.search(q.question, top_k=n, retrieval="hybrid")))
            for name, reranker in scorers.items():
                note(f"rerank {n}, {name}", engine.engine.call(reranker.rerank, q.question, rows).rerank_ms)
    return {name: _p50_p90(values) for name, values in times.items()}


def _p50_p90(values: list[float]) -> tuple[float, float]:
    ordered = sorted(values)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def open_set(name: str, work: Path):
    """(store, questions) of set `name`, ingested (incremental: reruns are free); None when its
    text cannot be fetched here."""
    built = build(name, work)
    if built is None:
        return None
    corpus, questions = built
    store = work / f"store-{name}"
    ragkv.ingest([corpus], store, model=ModelSettings(device="cpu", dtype="float32"))
    return store, questions


def score_set(store: Path, questions: list[Question], name: str) -> list[Candidates]:
    with ragkv.open(store, device="cpu", write_back=False, log_uses=False) as engine:
        runtime = engine.runtime
        rerankers = {
            label: reranking.KVReranker(runtime.loader, runtime.retriever, 0.0, text)
            for label, text in INSTRUCTIONS.items()
        }
        started = time.perf_counter()
        candidates = [candidates_of(engine, q, rerankers) for q in questions]
        print(f"{name}: {len(questions)} questions scored in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return candidates


def attend_set(store: Path, candidates: list[Candidates], lexical_weight: float, name: str) -> dict | None:
    """Attention scores of every pool; the latency table for the sample set."""
    with ragkv.open(store, device="cpu", write_back=False, log_uses=False) as engine:
        started = time.perf_counter()
        for found in candidates:
            score_attention(engine, found, lexical_weight)
        print(f"{name}: attention scored in {time.perf_counter() - started:.0f} s", file=sys.stderr)
        return latency(engine, [c.question for c in candidates[:LATENCY_QUESTIONS]]) if name == "sample" else None


def _cell(value: tuple[float, float, float]) -> str:
    mean, low, high = value
    return f"{mean:.3f} ({low:.2f}–{high:.2f})"


def report(results: dict, weights: dict, machine: str) -> str:
    lines = [
        "# Retrieval: first stages and the rerank from stored KV",
        "",
        f"Machine: {machine}. Model: bundled SmolLM2-135M-Instruct (float32); embedder all-MiniLM-L6-v2.",
        "Written by `python benchmarks/retrieval.py`; see its docstring for the method. Every quality number",
        "is on the test half of its set (weights chosen on the dev halves), with its 95% interval.",
        "",
        f"Chosen on the dev halves: hybrid's lexical weight {weights['lexical_weight']} "
        f"(ragkv.retrieval.search.LEXICAL_WEIGHT is {first_stages.LEXICAL_WEIGHT}); the rerank's first-stage weight "
        + ", ".join(f"{w} for {label}" for label, w in weights["first_weight"].items())
        + f" (ragkv.retrieval.rerank.FIRST_WEIGHT is {reranking.FIRST_WEIGHT}).",
        "",
    ]
    for name, (rows, timing, count) in results.items():
        lines += [f"## {name} ({count} questions, {count - count // 2} tested)", ""]
        lines += [
            "| first stage | rerank N | scorer | recall@1 | recall@5 | MRR@10 |",
            "|---|---|---|---|---|---|",
        ]
        for row in rows:
            lines.append(
                f"| {row['stage']} | {row['rerank'] or '—'} | {row['scorer'] or '—'} | "
                f"{_cell(row['recall@1'])} | {_cell(row['recall@5'])} | {_cell(row['mrr@10'])} |"
            )
        lines.append("")
        if timing:
            lines += [
                f"Latency, warm (ms; first {LATENCY_QUESTIONS} questions):",
                "",
                "| | p50 | p90 |",
                "|---|---|---|",
            ]
            lines += [f"| {what} | {p50:.0f} | {p90:.0f} |" for what, (p50, p90) in timing.items()]
            lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, help="downloads and stores, reused across runs")
    parser.add_argument("--sets", default=",".join(SETS))
    args = parser.parse_args()
    work = work_dir(args.work, "retrieval")
    sets = {name: found for name in args.sets.split(",") if (found := open_set(name, work)) is not None}
    scored = {name: score_set(store, questions, name) for name, (store, questions) in sets.items()}
    split_sets = {name: halves(candidates) for name, candidates in scored.items()}
    dev = {name: halves_[0] for name, halves_ in split_sets.items()}
    lexical_weight = choose_lexical_weight(dev)
    timings = {name: attend_set(sets[name][0], scored[name], lexical_weight, name) for name in scored}
    weights = {"lexical_weight": lexical_weight, "first_weight": choose_first_weights(dev, lexical_weight)}
    results = {
        name: (evaluate(split_sets[name][1], weights), timings[name], len(candidates))
        for name, candidates in scored.items()
    }
    text = report(results, weights, describe())
    OUT.write_text(text + "\n")
    (work / "retrieval.json").write_text(json.dumps({k: v[0] for k, v in results.items()} | {"weights": weights}))
    print(text)


if __name__ == "__main__":
    main()
