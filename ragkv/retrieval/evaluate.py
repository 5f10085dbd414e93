"""`ragkv eval`: a store measured on its owner's own questions, each retrieval setting asked for
side by side in one run.

Input, JSON lines, one question each, with what answers it (any of):

    {"question": "...", "doc_ids": ["a.md"]}          documents (or "doc_id", or "relevant")
    {"question": "...", "chunk_ids": [12, 13]}         chunks
    {"question": "...", "spans": ["rotate the key"]}   text the answer is in (any chunk holding it)
    {"question": "...", "doc_id": "a.md", "answer": "..."}   and a reference answer, for --answers

A result is relevant when it matches one of the question's targets, each target counted once
(the first result that matches it). Per setting:
- recall@k: the share of a question's targets within its first k results, averaged;
- MRR@10: 1 / the rank of the first relevant result within 10 (0 if none);
- nDCG@10: binary gains, discounted by log2(rank + 1), over the ideal ordering;
each with a 95% bootstrap interval over the questions, and p50/p90 latency per stage (embed,
dense, lexical, fuse, catalog, rerank, cross_encoder) and in all. With `answers`, each setting
also answers every question that has a reference, scored by exact match and token F1 (SQuAD's
normalisation: lowercase, no punctuation or articles).
"""

from __future__ import annotations

import json
import re
import shlex
import string
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ragkv.core.config import DEFAULT_RERANK, DEFAULT_RETRIEVAL, KV_RERANKER, RETRIEVALS, AskSettings, SearchSettings
from ragkv.core.errors import InputError, RagkvError

KS = (1, 5, 10)
BOOTSTRAP_ROUNDS = 1000
MAX_QUESTIONS = 100_000


@dataclass(frozen=True)
class Item:
    """One question and what answers it."""

    line: int
    question: str
    doc_ids: frozenset[str] = frozenset()
    chunk_ids: frozenset[int] = frozenset()
    spans: tuple[str, ...] = ()
    answer: str | None = None

    @property
    def targets(self) -> list[tuple[str, str | int]]:
        found: list[tuple[str, str | int]] = [("doc", d) for d in sorted(self.doc_ids)]
        found += [("chunk", c) for c in sorted(self.chunk_ids)]
        return found + [("span", _norm_space(s)) for s in self.spans]


def read_items(path: str | Path) -> list[Item]:
    """The questions of a JSON-lines file; InputError naming the first bad line."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read questions file {path}: {exc}") from None
    items = []
    for number, text in enumerate(lines, 1):
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError:
            raise InputError(f"{path} line {number} is not JSON") from None
        items.append(_item(record, number, path))
    if not items:
        raise InputError(f"{path} holds no questions")
    if len(items) > MAX_QUESTIONS:
        raise InputError(f"{path} holds {len(items)} questions; at most {MAX_QUESTIONS}")
    return items


def _item(record, number: int, path) -> Item:
    where = f"{path} line {number}"
    if not isinstance(record, dict) or not isinstance(record.get("question"), str) or not record["question"].strip():
        raise InputError(f'{where} has no "question"')
    doc_ids = record.get("doc_ids", record.get("relevant", [record["doc_id"]] if "doc_id" in record else []))
    chunk_ids, spans, answer = record.get("chunk_ids", []), record.get("spans", []), record.get("answer")
    if not (isinstance(doc_ids, list) and all(isinstance(d, str) for d in doc_ids)):
        raise InputError(f"{where}: doc_ids is a list of document ids")
    if not (isinstance(chunk_ids, list) and all(type(c) is int for c in chunk_ids)):
        raise InputError(f"{where}: chunk_ids is a list of chunk ids")
    if not (isinstance(spans, list) and all(isinstance(s, str) and s.strip() for s in spans)):
        raise InputError(f"{where}: spans is a list of texts")
    if answer is not None and not isinstance(answer, str):
        raise InputError(f"{where}: answer is a text")
    if not (doc_ids or chunk_ids or spans):
        raise InputError(f"{where} names nothing that answers it: give doc_ids, chunk_ids or spans")
    return Item(number, record["question"], frozenset(doc_ids), frozenset(chunk_ids), tuple(spans), answer)


@dataclass(frozen=True)
class Setting:
    """One retrieval setting compared: its words as given, and what they mean."""

    label: str
    retrieval: str = DEFAULT_RETRIEVAL
    rerank: int = DEFAULT_RERANK
    reranker: str = KV_RERANKER

    @classmethod
    def parse(cls, text: str) -> Setting:
        """`dense`, `hybrid --rerank 10`, `lexical`, `hybrid --rerank 20 --reranker MODEL`, ..."""
        words, values = shlex.split(text), {}
        if words and not words[0].startswith("--"):
            values["retrieval"] = words.pop(0)
        while words:
            option = words.pop(0)
            if option not in ("--rerank", "--reranker") or not words:
                raise InputError(f"--compare {text!r}: expected RETRIEVAL [--rerank N] [--reranker MODEL]")
            values[option[2:]] = words.pop(0)
        if values.get("retrieval", DEFAULT_RETRIEVAL) not in RETRIEVALS:
            raise InputError(f"--compare {text!r}: the retrieval is one of {', '.join(RETRIEVALS)}")
        try:
            rerank = int(values.get("rerank", DEFAULT_RERANK))
        except ValueError:
            raise InputError(f"--compare {text!r}: --rerank takes a number") from None
        setting = cls(text, values.get("retrieval", DEFAULT_RETRIEVAL), rerank, values.get("reranker", KV_RERANKER))
        setting.search(10)  # checked now, before any model loads
        return setting

    def search(self, top_k: int) -> SearchSettings:
        return SearchSettings(top_k, self.retrieval, self.rerank, reranker=self.reranker)


@dataclass
class Measured:
    """One setting's results over the questions."""

    label: str
    metrics: dict[str, dict[str, float]] = field(default_factory=dict)  # name -> {mean, low, high}
    latency_ms: dict[str, dict[str, float]] = field(default_factory=dict)  # stage -> {p50, p90}
    errors: int = 0
    answered: int = 0  # questions with a reference answer that were answered

    def to_dict(self) -> dict:
        return {
            "setting": self.label,
            "metrics": self.metrics,
            "latency_ms": self.latency_ms,
            "errors": self.errors,
            "answered": self.answered,
        }


def evaluate(
    engine, items: Sequence[Item], settings: Sequence[Setting], answers: bool = False, max_new_tokens: int = 64
) -> list[Measured]:
    """Every setting over every question (a setting at a time, the questions in order)."""
    return [_measure(engine, items, setting, answers, max_new_tokens) for setting in settings]


def _measure(engine, items: Sequence[Item], setting: Setting, answers: bool, max_new_tokens: int) -> Measured:
    per_question: dict[str, list[float]] = {name: [] for name in (*(f"recall@{k}" for k in KS), "mrr@10", "ndcg@10")}
    stages: dict[str, list[float]] = {}
    measured = Measured(setting.label)
    depth = max(*KS, 10)
    for item in items:
        start = time.perf_counter()
        try:
            found = engine.search(item.question, settings=setting.search(depth))
        except RagkvError:
            measured.errors += 1
            found = None
        total_ms = (time.perf_counter() - start) * 1000.0
        results = list(found) if found is not None else []
        for name, value in score(item, results).items():
            per_question[name].append(value)
        for stage, ms in (found.latency_ms if found is not None else {}).items():
            stages.setdefault(stage.removesuffix("_ms"), []).append(ms)
        stages.setdefault("total", []).append(total_ms)
    if answers:
        per_question |= _answers(engine, items, setting, max_new_tokens, measured)
    measured.metrics = {name: bootstrap(values) for name, values in per_question.items() if values}
    measured.latency_ms = {
        stage: {"p50": float(np.percentile(v, 50)), "p90": float(np.percentile(v, 90))} for stage, v in stages.items()
    }
    return measured


def score(item: Item, results: Sequence) -> dict[str, float]:
    """recall@k, MRR@10 and nDCG@10 of one question's ranked results (SearchResults)."""
    targets = item.targets
    first_match: dict[int, int] = {}  # target index -> the rank (0-based) of the first result matching it
    gains = []
    for rank, result in enumerate(results):
        new = [i for i, target in enumerate(targets) if i not in first_match and _matches(target, result)]
        for i in new:
            first_match[i] = rank
        gains.append(1.0 if new else 0.0)
    scores = {f"recall@{k}": sum(r < k for r in first_match.values()) / len(targets) for k in KS}
    relevant = [rank for rank, gain in enumerate(gains[:10]) if gain]
    scores["mrr@10"] = 1.0 / (relevant[0] + 1) if relevant else 0.0
    dcg = sum(gain / np.log2(rank + 2) for rank, gain in enumerate(gains[:10]))
    ideal = sum(1.0 / np.log2(rank + 2) for rank in range(min(len(targets), 10)))
    scores["ndcg@10"] = float(dcg / ideal) if ideal else 0.0
    return scores


def _matches(target: tuple[str, str | int], result) -> bool:
    kind, value = target
    if kind == "doc":
        return result.doc_id == value
    if kind == "chunk":
        return result.chunk_id == value
    return str(value).lower() in _norm_space(result.text).lower()


def _answers(
    engine, items: Sequence[Item], setting: Setting, max_new_tokens: int, measured: Measured
) -> dict[str, list[float]]:
    exact: list[float] = []
    f1: list[float] = []
    for item in items:
        if item.answer is None:
            continue
        options = {"retrieval": setting.retrieval, "rerank": setting.rerank, "reranker": setting.reranker}
        try:
            said = engine.ask(item.question, AskSettings.from_dict({**options, "max_new_tokens": max_new_tokens}))
        except RagkvError:
            measured.errors += 1
            continue
        measured.answered += 1
        exact.append(float(normalise(said.text) == normalise(item.answer)))
        f1.append(token_f1(said.text, item.answer))
    return {"exact_match": exact, "f1": f1} if exact else {}


def normalise(text: str) -> str:
    """SQuAD's answer normalisation: lowercase, no punctuation, no articles, single spaces."""
    text = "".join(c for c in text.lower() if c not in string.punctuation)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def token_f1(said: str, reference: str) -> float:
    """Token overlap F1 between an answer and its reference (normalised)."""
    a, b = normalise(said).split(), normalise(reference).split()
    common = sum((Counter(a) & Counter(b)).values())
    if not a or not b or not common:
        return float(a == b)
    precision, recall = common / len(a), common / len(b)
    return 2 * precision * recall / (precision + recall)


def bootstrap(values: Sequence[float], rounds: int = BOOTSTRAP_ROUNDS, seed: int = 0) -> dict[str, float]:
    """The mean and its 95% percentile-bootstrap interval over the questions."""
    data = np.asarray(values, dtype=np.float64)
    rng = np.random.default_rng(seed)
    means = data[rng.integers(0, len(data), size=(rounds, len(data)))].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return {"mean": float(data.mean()), "low": float(low), "high": float(high)}


def _norm_space(text: str) -> str:
    return " ".join(text.split())
