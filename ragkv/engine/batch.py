"""Answer a file of questions: every question is a turn submitted to the engine's continuous
batcher (ragkv.engine.scheduler), so `ragkv batch` retrieves, fits, loads KV, logs uses and counts
tokens exactly as `ask` and the service do, and decodes up to `max_batch` answers together.
Each answer equals the single-question `ask` answer (float32)."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass
from pathlib import Path

from ragkv.core.config import AskSettings, SearchSettings
from ragkv.core.errors import InputError, RagkvError
from ragkv.core.text import check_text
from ragkv.engine.answer import Answer
from ragkv.engine.request import Request


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
        assert self.answer is not None  # an outcome holds an answer or an error
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


def answer_all(
    engine, questions: list[Question], settings: AskSettings, max_batch: int = 16, on_done=None
) -> Iterator[BatchOutcome]:
    """Yield an outcome for every question, as each finishes (not in input order). At most
    twice `max_batch` questions are submitted ahead, so a long file holds little memory."""
    window = 2 * max_batch
    with engine.batched(max_batch=max_batch, max_queue=window):
        pending = iter(questions)
        running: dict = {}  # future -> its question
        while True:
            for question in pending:
                running[_submit(engine, question, settings).future] = question
                if len(running) >= window:
                    break
            if not running:
                return
            done, _ = wait(list(running), return_when=FIRST_COMPLETED)
            for future in done:
                yield _outcome(running.pop(future), future)
                if on_done:
                    on_done(1)


def run_batch(
    engine,
    questions: list[Question],
    errors: list[BatchOutcome],
    settings: AskSettings,
    write,
    reporter,
    max_batch: int = 16,
) -> dict:
    """`ragkv batch`: every outcome written as a JSON line through `write` (the unusable lines'
    errors first), progress to `reporter`; returns the summary (counts, time, prefill savings)."""
    started = time.perf_counter()
    for outcome in errors:
        write(json.dumps(outcome.to_dict()) + "\n")
    failed = [outcome.error for outcome in errors]
    reporter.stage("questions", len(questions), "questions")
    answered = 0
    for outcome in answer_all(engine, questions, settings, max_batch=max_batch, on_done=reporter.advance):
        write(json.dumps(outcome.to_dict()) + "\n")
        answered += outcome.error is None
        if outcome.error:
            failed.append(outcome.error)
    reporter.done()
    seconds = time.perf_counter() - started
    return {
        "questions": answered + len(failed),
        "answered": answered,
        "errors": failed,
        "seconds": round(seconds, 3),
        "questions_per_s": round(answered / seconds, 3) if seconds else 0.0,
        "savings": engine.savings.to_dict(),
    }


def search_all(engine, questions: list[Question], settings: SearchSettings) -> Iterator[dict]:
    """Yield `{"id", "results"}` (and "warnings" when any; `{"id", "line", "error"}` for a
    question that cannot be searched) for every question, in order: what `engine.search`
    finds for it."""
    for question in questions:
        pinned = dataclasses.replace(settings, doc_ids=(question.doc,)) if question.doc else settings
        try:
            found = engine.search(question.question, settings=pinned)
        except RagkvError as exc:
            yield {"id": question.id, "line": question.line, "error": str(exc)}
            continue
        yield {"id": question.id, "results": [r.to_dict() for r in found], "latency_ms": found.latency_ms} | (
            {"warnings": found.warnings} if found.warnings else {}
        )


def _submit(engine, question: Question, settings: AskSettings) -> Request:
    pinned = dataclasses.replace(settings, doc_ids=(question.doc,)) if question.doc else settings
    return engine.engine.submit_question(question.question, pinned, runtime=engine.runtime)


def _outcome(question: Question, future) -> BatchOutcome:
    try:
        answer: Answer = future.result()
    except RagkvError as exc:
        return BatchOutcome(question, error=str(exc))
    return BatchOutcome(question, answer)
