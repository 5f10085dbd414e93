"""The rerank that reads the stored KV: each candidate chunk is scored by how likely the model
finds the question after it, log P(question | prefix + chunk), the query likelihood of an LLM
reranker. A cross-encoder or an LLM reranker elsewhere reads every candidate's text again; here
the candidate's KV is already in the store, so scoring it costs only the question's tokens,
prefilled over that KV, with all the candidates as the rows of one batch.

The prompt scored is the answer's own: prefix, the chunk (a span's chunk: its span's chunks
from the start, whose KV it continues), then the question head ("\\n\\nQuestion: ") and the
question. The model's score is the mean log-probability of the question's tokens. The order
combines it with the first stage's: both standardised over the candidates (z-scores, so the
weight holds whatever scale the first stage's score has), the first stage's times
`first_weight` (benchmarks/retrieval.py measured the weight; see the README)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ragkv.core.errors import StoreCorruptError
from ragkv.kv import cache as kv
from ragkv.kv.entry import Entry
from ragkv.loading.loader import KVLoader, Loaded
from ragkv.model.forward import compute_chunks
from ragkv.model.prompt import encode_text
from ragkv.modes import assemble
from ragkv.modes.attention_probe import Probe, probed_forward
from ragkv.retrieval.retriever import Retrieved, Retriever
from ragkv.store import ContextRow

FIRST_WEIGHT = 3.0  # the first stage's z-score's weight beside the model's (benchmarks/retrieval.py: dev halves)
INSTRUCTION = ""  # "": the answer prompt's own question head ("\n\nQuestion: ")
CALIBRATION = "N/A"  # attention: the content-free question whose attention is subtracted (ICR's)
BATCH_TOKENS = 16_384  # rows x (context + question) tokens per forward: bounds the rerank's memory


@dataclass(frozen=True)
class Scored:
    """A candidate after the rerank: its row, the first stage's score, and the model's."""

    row: ContextRow
    first_score: float  # the retrieval's (cosine, or fused) score
    model_score: float  # likelihood: mean log P(question token | chunk), in nats; attention: calibrated mass
    score: float  # what the candidates are ordered by


@dataclass
class Reranked:
    """What `KVReranker.rerank` did: the candidates, best first, and what it cost."""

    scored: list[Scored]
    rerank_ms: float = 0.0
    num_from_text: int = 0  # candidates whose KV the store lacked: prefilled from their text
    warnings: list[str] = field(default_factory=list)


class KVReranker:
    """Scores candidates with the engine's model over their stored KV (the loader's RAM tier and
    verified reads, so the answer that follows finds its chunks loaded)."""

    def __init__(
        self,
        loader: KVLoader,
        retriever: Retriever,
        first_weight: float,
        instruction: str = INSTRUCTION,
        score: str = "likelihood",
    ):
        self.loader = loader
        self.retriever = retriever
        self.first_weight = first_weight
        self.instruction = instruction  # the text between the chunk and the question scored
        self.score = score  # "likelihood" (each candidate a row) or "attention" (all in one concatenated cache)

    def rerank(self, question: str, candidates: Retrieved) -> Reranked:
        """`candidates` (row, first-stage score), ordered by the model's score, best first."""
        start = time.perf_counter()
        layout = self.loader.active.layout
        tokenizer = self.loader.lm.tokenizer
        head = encode_text(tokenizer, self.instruction) if self.instruction else list(layout.question_head_ids)
        question_ids = [*head, *encode_text(tokenizer, question)]
        num_scored = len(question_ids) - len(head)
        if num_scored < 1:  # nothing to score (a question the tokenizer makes nothing of)
            return Reranked([Scored(row, first, 0.0, first) for row, first in candidates])
        loaded = Loaded(self.loader.empty())
        contexts, num_from_text = [], 0
        for row, _ in candidates:
            context, from_text = self._context_kv(row, loaded)
            contexts.append(context)
            num_from_text += from_text
        prefix = self.loader.prefix_kv()
        model = self.loader.lm.model
        if self.score == "attention":
            calibration = [*head, *encode_text(tokenizer, CALIBRATION)]
            model_scores = attention_mass(model, prefix, contexts, question_ids, calibration)
        else:
            model_scores = question_likelihoods(model, [[prefix, c] for c in contexts], question_ids, num_scored)
        fused = fuse(model_scores, [first for _, first in candidates], self.first_weight)
        scored = [
            Scored(row, first, model_score, score)
            for (row, first), model_score, score in zip(candidates, model_scores, fused, strict=True)
        ]
        scored.sort(key=lambda s: -s.score)
        warnings = [f"{num_from_text} rerank candidates had no stored KV: scored from their text"] * bool(num_from_text)
        return Reranked(scored, (time.perf_counter() - start) * 1000.0, num_from_text, warnings)

    def _context_kv(self, row: ContextRow, loaded: Loaded) -> tuple[Entry, bool]:
        """The entry a candidate is scored over, and whether it was computed
        from text. What the store lacks of a candidate's span the loader computes and writes
        back, as for an answer; only a damaged entry leaves the candidate scored from text."""
        run = [r for r, _ in self.retriever.widen([(row, 0.0)], "span")]
        try:
            return self.loader.run_kv(run, loaded, slot=len(loaded.kv_sources)), False
        except StoreCorruptError:
            lm = self.loader.lm
            ids = self.loader.active.layout.context_ids([self.retriever.chunk_token_ids(r) for r in run])
            (result,) = compute_chunks(lm.model, self.loader.prefix_kv(), [ids], len(ids), lm.pad_id)
            return result.kv.to(lm.model.device), True


def fuse(likelihoods: Sequence[float], first_scores: Sequence[float], first_weight: float) -> list[float]:
    """z(likelihood) + first_weight * z(first-stage score), each standardised over the candidates."""
    return [a + first_weight * b for a, b in zip(standardised(likelihoods), standardised(first_scores), strict=True)]


def standardised(values: Sequence[float]) -> list[float]:
    mean = statistics.fmean(values)
    spread = statistics.pstdev(values) or 1.0  # all equal: no information, all zero
    return [(v - mean) / spread for v in values]


@torch.inference_mode()
def attention_mass(
    model,
    prefix: Entry,
    contexts: Sequence[Entry],
    question_ids: Sequence[int],
    calibration_ids: Sequence[int],
) -> list[float]:
    """In-context reranking (ICR, Chen et al. 2024): every candidate's entry (plain layouts)
    placed after `prefix` in one cache (re-rotated, as `--mode concat` places them), the
    question run over it once, and each candidate scored by the attention mass the question's
    tokens put on it (summed over layers and heads, per question token), less the mass a
    content-free question (`calibration_ids`) puts there: one forward of the question and one
    of the calibration, whatever the number of candidates."""
    assembly = assemble.concat(model, prefix, contexts)
    num_prefix = kv.num_tokens(prefix)
    bounds = np.cumsum([num_prefix, *(kv.num_tokens(c) for c in contexts)])  # each candidate's [start, stop)
    masses = [[0.0] * len(contexts), [0.0] * len(contexts)]
    for which, ids in enumerate((question_ids, calibration_ids)):
        if not ids:
            continue
        probe = Probe(int(bounds[-1]))
        query = torch.tensor([list(ids)], dtype=torch.long, device=model.device)  # (1, Q)
        probed_forward(model, probe, input_ids=query, cache=assembly.cache, use_cache=True, logits_to_keep=1)
        kv.crop(assembly.cache, int(bounds[-1]))
        assert probe.mass is not None  # the forward above ran the probe
        per_token = probe.mass.cpu() / len(ids)  # (C,)
        masses[which] = [float(per_token[bounds[i] : bounds[i + 1]].sum()) for i in range(len(contexts))]
    return [asked - calibrated for asked, calibrated in zip(*masses, strict=True)]


@torch.inference_mode()
def question_likelihoods(
    model, contexts: Sequence[Sequence[Entry]], question_ids: Sequence[int], num_scored: int
) -> list[float]:
    """For each context (entries, one after another; a recurrent state is the last one's), the
    mean log-probability of the last `num_scored` of `question_ids` fed after it. Rows are
    batched up to BATCH_TOKENS; each row computes what it would alone (its own positions, its
    padding masked)."""
    lengths = [sum(kv.num_tokens(p) for p in parts) for parts in contexts]
    order = sorted(range(len(contexts)), key=lambda i: -lengths[i])
    scores = [0.0] * len(contexts)
    batch: list[int] = []
    for i in order:
        if batch and (len(batch) + 1) * (lengths[batch[0]] + len(question_ids)) > BATCH_TOKENS:
            _score_batch(model, [contexts[j] for j in batch], question_ids, num_scored, batch, scores)
            batch = []
        batch.append(i)
    if batch:
        _score_batch(model, [contexts[j] for j in batch], question_ids, num_scored, batch, scores)
    return scores


def _score_batch(model, contexts, question_ids, num_scored: int, indices: list[int], scores: list[float]) -> None:
    cache, lengths = kv.left_padded(contexts, model.config)
    width, num_rows, num_new = max(lengths), len(contexts), len(question_ids)
    mask = torch.zeros((num_rows, width + num_new), dtype=torch.long)  # (B, W + Q): 1 where a row has a token
    for row, length in enumerate(lengths):
        mask[row, width - length :] = 1
    positions = torch.tensor(lengths)[:, None] + torch.arange(num_new)[None, :]  # (B, Q): each row's own
    ids = torch.tensor([list(question_ids)] * num_rows, dtype=torch.long)  # (B, Q)
    device = model.device
    logits = model(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        position_ids=positions.to(device),
        cache=cache,
        use_cache=True,
        logits_to_keep=num_scored + 1,
    ).logits  # (B, num_scored + 1, V): the last predicts past the question
    log_probs = logits[:, :-1].float().log_softmax(-1)  # (B, num_scored, V)
    targets = ids[:, -num_scored:].to(device)[..., None]  # (B, num_scored, 1)
    means = log_probs.gather(-1, targets).squeeze(-1).mean(-1)  # (B,)
    for row, index in enumerate(indices):
        scores[index] = float(means[row])
