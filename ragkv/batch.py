"""Answer many questions at once: retrieve for all, group the questions whose prompts share a
context, load that context once, prefill the group's questions as one padded batch on top of
it and decode them together. Each answer equals the single-question `ask` answer (float32)."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ragkv import kv
from ragkv.answer import Answer, Source, Stats
from ragkv.config import AskSettings
from ragkv.errors import InputError
from ragkv.generate import generate_batch, prefill
from ragkv.text import check_text


@dataclass(frozen=True)
class Question:
    id: str
    question: str
    doc: str | None = None  # pin retrieval to this document
    line: int = 0


@dataclass
class BatchOutcome:
    question: Question
    answer: Answer | None = None
    error: str | None = None

    def to_dict(self) -> dict:
        if self.error is not None:
            return {"id": self.question.id, "line": self.question.line, "error": self.error}
        return {"id": self.question.id, **self.answer.to_dict()}


def read_questions(path: Path) -> tuple[list[Question], list[BatchOutcome]]:
    """Questions from a JSONL file (`{"id", "question", "doc"?}` per line), and one error
    outcome per line that cannot be used (named by its line number)."""
    try:
        lines = Path(path).read_bytes().removeprefix(b"\xef\xbb\xbf").splitlines()
    except OSError as exc:
        raise InputError(f"cannot read questions from {path}: {exc.strerror or exc}") from None
    questions, errors = [], []
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(f"not UTF-8 (byte {exc.start})") from None
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"not JSON ({exc.msg})") from None
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
            question = record.get("question")
            if not isinstance(question, str) or not question.strip():
                raise ValueError('no "question" text')
            check_text(question)
            doc = record.get("doc")
            if doc is not None and not isinstance(doc, str):
                raise ValueError('"doc" must be a document id string')
            questions.append(Question(str(record.get("id", number)), question, doc, number))
        except (ValueError, InputError) as exc:
            errors.append(BatchOutcome(Question(str(number), "", None, number), error=f"line {number}: {exc}"))
    return questions, errors


def answer_all(engine, questions: list[Question], settings: AskSettings, max_batch: int = 16,
               on_done=None) -> Iterator[BatchOutcome]:
    """Yield an outcome for every question (in groups, not in input order)."""
    settings.check_batchable("ragkv batch")
    groups: dict[tuple[int, ...], list[tuple[Question, list]]] = {}
    for question in questions:
        try:
            retrieved = engine.retrieve(question.question, settings.top_k,
                                        [question.doc] if question.doc else settings.doc_ids, settings.context)
        except InputError as exc:
            yield BatchOutcome(question, error=str(exc))
            continue
        key = tuple(row.chunk_id for row, _ in retrieved)
        groups.setdefault(key, []).append((question, retrieved))
    for members in groups.values():
        for start in range(0, len(members), max_batch):
            part = members[start:start + max_batch]
            yield from _answer_group(engine, part, settings)
            if on_done:
                on_done(len(part))


def _answer_group(engine, members, settings: AskSettings) -> Iterator[BatchOutcome]:
    """One shared context, several questions: assemble and finish the context once (batch 1),
    copy it to every row, then prefill and decode the questions together."""
    start = time.perf_counter()
    layout, tokenizer, model = engine.active.layout, engine.lm.tokenizer, engine.lm.model
    retrieved = members[0][1]
    rows = [row for row, _ in retrieved]
    chunk_ids = [engine.chunk_token_ids(row) for row in rows]
    context_ids = [*layout.prefix_ids, *layout.context_ids(chunk_ids)]
    stats = Stats(mode=settings.mode if settings.use_cache else "full", store_generation=engine.snapshot.generation)
    assembly = engine.assemble(rows, chunk_ids, settings, stats)
    shared_live = context_ids[assembly.num_cached:]
    if shared_live:
        prefill(model, shared_live, assembly.cache)
        if assembly.after_prefill:
            assembly.after_prefill(assembly.cache)
    questions = [layout.question_ids(tokenizer, q.question) for q, _ in members]
    budget = min(settings.max_new_tokens, engine.lm.facts.max_context - len(context_ids) - max(map(len, questions)))
    if budget < 1:
        for question, _ in members:
            yield BatchOutcome(question, error="the question and its context do not fit the model's context")
        return
    kv.repeat_batch(assembly.cache, len(members))
    done = generate_batch(model, tokenizer, assembly.cache, questions, engine.lm.facts.eos_ids, budget,
                          engine.lm.pad_id, settings.decoding)
    elapsed = time.perf_counter() - start
    for i, (question, hits) in enumerate(members):
        row_stats = dataclasses.replace(stats, warnings=list(stats.warnings))
        row_stats.reused_tokens = assembly.reused_tokens
        row_stats.recomputed_tokens = assembly.recomputed_tokens
        row_stats.computed_tokens = len(context_ids) - assembly.reused_tokens - assembly.recomputed_tokens + len(questions[i])
        row_stats.generated_tokens = len(done.token_ids[i])
        row_stats.finish_reason = done.finish_reasons[i]
        row_stats.batch_size = len(members)
        row_stats.prefill_ms = done.prefill_s * 1000.0
        row_stats.ttft_s = elapsed - done.decode_s  # the group's first tokens all come at once
        row_stats.decode_s = done.decode_s
        row_stats.total_s = elapsed
        sources = [Source(r.doc_id, r.source, r.chunk_index, r.chunk_id, score) for r, score in hits]
        text = done.texts[i]
        engine.savings.add(row_stats)
        yield BatchOutcome(question, Answer(question.question, text, done.token_ids[i], sources, row_stats,
                                            [*context_ids, *questions[i]]))
