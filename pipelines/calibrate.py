"""`ragkv calibrate`: what `--mode approximate` should run as on this store and model, measured.

Held-in questions are drawn from the store's own chunks, evenly over the corpus, in three
shapes taken in turn: "What does the text say about <the chunk's first sentence>?", "Is it true
that <a later sentence>?", and a search-box query of the chunk's rarest words. Each retrieves
`top_k` chunks. For each one a
full prefill gives the reference: its first answer token and its greedy answer (no repetition
controls, so the answer is the argmax path). Each approximate mode is then measured at growing
recompute shares until it reaches the target first-token agreement:
- first-token agreement: the mode's top first token equals the full prefill's;
- teacher-forced agreement: the reference answer fed after the mode's cache, the share of
  positions whose top token is the reference's;
- time to first token over the full prefill's (medians; RAM tier and prefix cache emptied).
A configuration reaches the target when the lower end of its first-token agreement's one-sided
90% interval does (ragkv.modes.calibration.lower_bound), so the default 32 questions must nearly all
agree. The fastest configuration that reached the target, and only if faster than exact, is
recorded in the store's catalog (ragkv.modes.calibration); when none is, `--mode approximate`
answers exactly.
"""

from __future__ import annotations

import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ragkv.core.config import AskSettings
from ragkv.core.errors import InputError
from ragkv.engine.query import QueryEngine
from ragkv.model.generate import prefill
from ragkv.modes.calibration import Calibration, Measured, choose, lower_bound, meta_key
from ragkv.pipelines.progress import Reporter
from ragkv.store.writer import open_writer

SENTENCE_END = re.compile(r"(?<=[.!?])\s|\n")
PLAIN = {"repetition_penalty": 1.0, "no_repeat_ngram": 0}  # the reference answer is the argmax path


@dataclass(frozen=True)
class CalibrateSettings:
    questions: int = 32
    top_k: int = 5
    target: float = 0.9  # first-token agreement a configuration must reach
    tokens: int = 16  # reference answer tokens fed for teacher-forced agreement
    modes: tuple[str, ...] = ("epic", "query", "blend")
    shares: tuple[float, ...] = (0.05, 0.1, 0.2, 0.3, 0.5)

    def __post_init__(self):
        if self.questions < 1 or self.top_k < 2:
            raise InputError(
                f"--questions must be at least 1 and --top-k at least 2 (approximate modes compose "
                f"several chunks), got {self.questions} and {self.top_k}"
            )
        if not 0.0 < self.target <= 1.0:
            raise InputError(f"--target must be above 0 and at most 1, got {self.target}")


@dataclass(frozen=True)
class Reference:
    question: str
    answer_ids: list[int]
    ttft_s: float


WORD = re.compile(r"[^\W\d_]{4,}")  # a word of 4 letters or more


def held_in_questions(catalog, count: int) -> list[str]:
    """Up to `count` questions, each about one chunk, chunks spread evenly, the shapes in turn
    (module docstring)."""
    ids = sorted(catalog.documents.chunk_ids())
    picked = ids[:: max(1, len(ids) // count)][:count]
    questions = []
    for i, text in enumerate(catalog.documents.chunk_texts(picked).values()):
        sentences = [s for s in (_clause(part) for part in SENTENCE_END.split(text.strip())) if s]
        if not sentences:
            continue
        later = [s for s in sentences[1:] if len(s.split()) >= 5]  # a statement, not a heading
        if i % 3 == 1 and later:
            statement = later[len(later) // 2]
            if statement[1:2].islower():  # "The ..." reads "the ...", "API ..." stays
                statement = statement[0].lower() + statement[1:]
            questions.append(f"Is it true that {statement}?")
        elif i % 3 == 2 and (keywords := _rarest_words(text, 5)):
            questions.append(" ".join(keywords))
        else:
            questions.append(f"What does the text say about {sentences[0]}?")
    return questions


def _clause(sentence: str) -> str:
    """A sentence cut to its first 20 words, without markup before it or punctuation after."""
    return " ".join(sentence.lstrip("#*->| \t").split()[:20]).rstrip(".!?:;,")


def _rarest_words(text: str, count: int) -> list[str]:
    """The text's `count` longest distinct words (a stand-in for its rarest), in text order."""
    words = list(dict.fromkeys(w.lower() for w in WORD.findall(text)))
    kept = set(sorted(words, key=len, reverse=True)[:count])
    return [w for w in words if w in kept]


def calibrate(
    store: Path | str, settings: CalibrateSettings, reporter: Reporter, model: str | None = None, device: str = "auto"
) -> Calibration:
    """Measure, choose and record (module docstring); returns what was recorded."""
    with QueryEngine(store, model=model, device=device, write_back=False, log_uses=False) as engine:  # not traffic
        questions = held_in_questions(engine.snapshot.catalog, settings.questions)
        if not questions:
            raise InputError(f"store {store} holds no chunk text to draw calibration questions from")
        reporter.stage("calibrate", len(questions) * (1 + len(settings.modes) * len(settings.shares)), "measurements")
        references = [_reference(engine, q, settings) for q in questions]
        reporter.advance(len(references))
        exact = _measure(engine, references, AskSettings(top_k=settings.top_k), settings)
        measured = []
        for mode in settings.modes:
            for share in settings.shares:
                measured.append(
                    _measure(
                        engine, references, AskSettings(top_k=settings.top_k, mode=mode, blend_ratio=share), settings
                    )
                )
                reporter.advance(len(references))
                if measured[-1].assured >= settings.target:
                    break
        reporter.done()
        profile_id = engine.active.profile.profile_id
    chosen = choose(measured, settings.target, exact.ttft_ratio)
    result = Calibration(settings.target, settings.top_k, len(references), exact.ttft_ratio, chosen, measured)
    with open_writer(store) as writer:
        writer.catalog.set_meta({meta_key(profile_id): result.to_json()})
    return result


def cold(engine) -> None:
    """The RAM tier and prefix cache emptied: the next prompt's KV is read from the store."""
    engine.ram = type(engine.ram)(engine.ram.max_bytes)
    engine.prefix_cache = type(engine.prefix_cache)(engine.prefix_cache.max_bytes)


def _reference(engine, question: str, settings: CalibrateSettings) -> Reference:
    cold(engine)
    answer = engine.ask(question, top_k=settings.top_k, max_new_tokens=settings.tokens, use_cache=False, **PLAIN)
    return Reference(question, answer.token_ids, answer.stats.ttft_s)


@dataclass(frozen=True)
class Forced:
    """A prompt's cache per some settings, with a reference answer fed after it."""

    first_logits: torch.Tensor  # (V,) float32: the next-token logits after the prompt
    agreement: float  # share of the answer's positions whose top token is the answer's
    seconds: float  # from preparing the prompt to its first logits


@torch.inference_mode()
def teacher_forced(engine, question: str, ask: AskSettings, answer_ids: list[int]) -> Forced:
    """`ask`'s cache for `question` (prepared now: whatever the engine holds is used), then
    `answer_ids` fed after it in one forward."""
    start = time.perf_counter()
    prepared = engine.prepare(question, ask)
    assembly = prepared.assembly
    model, cache = assembly.attending(engine.lm.model), assembly.cache
    head = prefill(model, prepared.live_ids, cache, assembly.recompute).float()  # (V,) query: recomputes with it
    seconds = time.perf_counter() - start
    tops = [int(head.argmax())]
    if len(answer_ids) > 1:
        rest = torch.tensor([answer_ids[:-1]], dtype=torch.long, device=model.device)  # (1, A - 1)
        tops += (
            model(input_ids=rest, cache=cache, use_cache=True, logits_to_keep=rest.shape[1])
            .logits[0]
            .argmax(-1)
            .tolist()
        )
    return Forced(head, sum(a == b for a, b in zip(tops, answer_ids, strict=False)) / len(answer_ids), seconds)


def _measure(engine, references: list[Reference], ask: AskSettings, settings: CalibrateSettings) -> Measured:
    first, forced, ttft = [], [], []
    for ref in references:
        if not ref.answer_ids:
            continue
        cold(engine)
        result = teacher_forced(engine, ref.question, ask, ref.answer_ids)
        ttft.append(result.seconds)
        first.append(int(result.first_logits.argmax()) == ref.answer_ids[0])
        forced.append(result.agreement)
    full_ttft = statistics.median(r.ttft_s for r in references)
    return Measured(
        ask.mode,
        ask.blend_ratio or 0.0,
        statistics.mean(first) if first else 0.0,
        statistics.mean(forced) if forced else 0.0,
        statistics.median(ttft) / full_ttft if ttft and full_ttft else 1.0,
        lower_bound(sum(first), len(first)),
    )
