"""The online path: retrieve, load the stored KV as the prompt prefix, prefill only the rest,
generate. `QueryEngine` is what `ragkv.open()` returns and what the CLI's `ask` drives."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Generator, Iterator

import torch

from ragkv import kv
from ragkv.answer import Answer, Source, Stats
from ragkv.config import AskSettings, resolve_device, resolve_dtype
from ragkv.embed import Embedder
from ragkv.errors import InputError, ModelError, StoreCorruptError, StoreEmptyError
from ragkv.generate import TextStream, greedy_decode, prefill
from ragkv.keys import KVKey, Profile
from ragkv.model import LoadedModel, load_model, model_name
from ragkv.prompt import PromptLayout, encode_text
from store import ContextRow, StoreSnapshot, open_snapshot
from store.generations import read_current

log = logging.getLogger("ragkv")


@dataclass(frozen=True)
class ActiveProfile:
    """The stored profile this engine answers with, checked against the live model."""

    profile: Profile
    layout: PromptLayout
    system_prompt: str


@dataclass
class _Prepared:
    retrieved: list[tuple[ContextRow, float]]
    prompt_ids: list[int]  # the whole prompt
    live_ids: list[int]  # the part to prefill now (after what the cache holds)
    cache: object  # transformers cache (built by ragkv.kv) holding the prompt ids before live_ids


class AnswerStream:
    """Iterate for text deltas as they are generated; `.answer` holds the `Answer` afterwards."""

    def __init__(self, steps: Generator[str, None, Answer]):
        self._steps = steps
        self.answer: Answer | None = None

    def __iter__(self) -> Iterator[str]:
        self.answer = yield from self._steps


class QueryEngine:
    """Answers questions from a store. Loads the model and embedder once; holds the store's
    published generation open (a re-index published later is seen by the next `open`)."""

    def __init__(self, store: Path | str, model: str | None = None, embedder: str | None = None,
                 device: str = "auto", dtype: str | None = None):
        self.snapshot: StoreSnapshot = open_snapshot(store)
        try:
            meta = self.snapshot.catalog.meta()
            self.device = resolve_device(device)
            self.lm, self.active = self._load_model(model, dtype)
            self.embedder = self._load_embedder(embedder or meta["embedder"], meta)
        except BaseException:
            self.snapshot.close()
            raise
        self._prefix_kv: torch.Tensor | None = None  # pinned in memory after the first load

    # -- setup ----------------------------------------------------------------------------
    def _load_model(self, name: str | None, dtype: str | None) -> tuple[LoadedModel, ActiveProfile]:
        rows = self.snapshot.catalog.profiles()
        if not rows:
            raise StoreEmptyError(f"store {self.snapshot.root} holds no KV; add documents with: ragkv ingest DOCS")
        last = self.snapshot.catalog.meta().get("last_profile")
        default = next((r for r in rows if r["profile_id"] == last), rows[0])
        name = model_name(name) if name else default["model_name"]
        same_name = [r for r in rows if r["model_name"] == name]
        dtype = resolve_dtype(dtype, self.device) if dtype else (same_name[0]["dtype"] if same_name else default["dtype"])
        lm = load_model(name, self.device, dtype)
        candidates = [r for r in rows if r["model_fingerprint"] == lm.facts.fingerprint and r["dtype"] == dtype]
        if not candidates:
            held = ", ".join(sorted({f"{r['model_name']} ({r['dtype']})" for r in rows}))
            raise ModelError(
                f"store {self.snapshot.root} has no KV for model {name} in {dtype} (it holds: {held}); "
                f"ingest with --model {name} --dtype {dtype}, or omit --model"
            )
        row = next((r for r in candidates if r["profile_id"] == last), candidates[0])
        layout = PromptLayout.build(lm.tokenizer, row["system_prompt"])
        profile = Profile(
            model_fingerprint=lm.facts.fingerprint,
            tokenizer_fingerprint=lm.facts.tokenizer_fingerprint,
            template_fingerprint=layout.template_fingerprint,
            prefix_ids=layout.prefix_ids,
            dtype=dtype,
            kv_quant=row["kv_quant"],
        )
        if profile.profile_id != row["profile_id"]:
            raise ModelError(
                f"model {name}'s tokenizer or chat template differs from when store {self.snapshot.root} was built; "
                "re-run ragkv ingest to recompute the KV"
            )
        return lm, ActiveProfile(profile, layout, row["system_prompt"])

    def _load_embedder(self, name: str, meta: dict) -> Embedder:
        embedder = Embedder.load(name, self.device)
        if embedder.fingerprint != meta.get("embedder_fingerprint"):
            raise ModelError(
                f"embedder {name} differs from the one store {self.snapshot.root} was built with "
                f"({meta.get('embedder')}); omit --embedder"
            )
        return embedder

    def refresh(self) -> bool:
        """Switch to the store's newest published generation if there is one (between
        questions: an answer always comes from one generation). Returns whether it switched."""
        if read_current(self.snapshot.root) == self.snapshot.generation:
            return False
        snapshot = open_snapshot(self.snapshot.root)
        profile_id = self.active.profile.profile_id
        if all(p["profile_id"] != profile_id for p in snapshot.catalog.profiles()):
            snapshot.close()
            raise ModelError(f"the store's new generation no longer holds KV for model {self.lm.facts.name}; reopen it")
        self.snapshot.close()
        self.snapshot = snapshot
        return True

    # -- the query path -------------------------------------------------------------------
    def retrieve(self, question: str, top_k: int = 1) -> list[tuple[ContextRow, float]]:
        """The `top_k` chunks nearest to `question`, best first, with their cosine scores."""
        vector = self.embedder.embed([question])[0]
        hits = self.snapshot.vectors.search(vector, top_k)
        rows = self.snapshot.catalog.context_rows(self.active.profile.profile_id, [h.chunk_id for h in hits])
        scores = {h.chunk_id: h.score for h in hits}
        return [(row, scores[row.chunk_id]) for row in rows]

    def ask(self, question: str, settings: AskSettings | None = None, **options) -> Answer:
        """Answer `question` (options as in `AskSettings`: top_k, max_new_tokens, use_cache)."""
        stream = self.stream(question, settings, **options)
        for _ in stream:
            pass
        return stream.answer

    def stream(self, question: str, settings: AskSettings | None = None, **options) -> AnswerStream:
        """Like `ask`, but iterate the result for text as it is generated."""
        settings = settings or AskSettings.from_dict(options)
        if not question.strip():
            raise InputError("the question is empty; ask something")
        return AnswerStream(self._answer(question, settings))

    def first_token_logits(self, question: str, settings: AskSettings | None = None, **options) -> torch.Tensor:
        """The next-token logits `(V,)` after the prompt, as `ask` would see them (for comparing
        the cached path with a full prefill: exactness tests, fidelity evaluations)."""
        settings = settings or AskSettings.from_dict(options)
        prepared = self._prepare(question, settings, Stats(mode="cached" if settings.use_cache else "full"))
        return prefill(self.lm.model, prepared.live_ids, prepared.cache).float()

    def _prepare(self, question: str, settings: AskSettings, stats: Stats) -> "_Prepared":
        """Retrieve, build the prompt ids, and load what the store holds of it into a cache."""
        start = time.perf_counter()
        layout = self.active.layout
        retrieved = self.retrieve(question, settings.top_k)
        stats.retrieval_ms = _ms(start)
        chunk_ids = [self._chunk_token_ids(row) for row, _ in retrieved]
        prompt_ids = layout.prompt_ids(chunk_ids, layout.question_ids(self.lm.tokenizer, question))
        load_start = time.perf_counter()
        stored = self._load_stored(retrieved[0][0], stats) if settings.use_cache and retrieved else None
        if stored is not None:
            cache = kv.to_cache(stored, self.lm.model.config)
            stats.reused_tokens = sum(kv.num_tokens(t) for t in stored)
        else:
            cache = kv.to_cache_empty(self.lm.model.config)
        stats.kv_load_ms = _ms(load_start)
        live_ids = prompt_ids[stats.reused_tokens:]
        stats.computed_tokens = len(live_ids)
        return _Prepared(retrieved, prompt_ids, live_ids, cache)

    def _answer(self, question: str, settings: AskSettings) -> Generator[str, None, Answer]:
        start = time.perf_counter()
        stats = Stats(mode="cached" if settings.use_cache else "full", store_generation=self.snapshot.generation)
        prepared = self._prepare(question, settings, stats)
        max_new_tokens = self._fit_budget(len(prepared.prompt_ids), settings.max_new_tokens, stats)

        prefill_start = time.perf_counter()
        logits = prefill(self.lm.model, prepared.live_ids, prepared.cache)
        stats.prefill_ms = _ms(prefill_start)

        text = TextStream(self.lm.tokenizer)
        decode = greedy_decode(self.lm.model, logits, prepared.cache, self.lm.facts.eos_ids, max_new_tokens)
        decode_start = time.perf_counter()
        while True:
            try:
                token = next(decode)
            except StopIteration as done:
                stats.finish_reason = done.value
                break
            if not text.token_ids:
                stats.ttft_s = time.perf_counter() - start
            if delta := text.push(token):
                yield delta
        if tail := text.finish():
            yield tail
        stats.ttft_s = stats.ttft_s or time.perf_counter() - start
        stats.generated_tokens = len(text.token_ids)
        stats.decode_s = time.perf_counter() - decode_start
        stats.total_s = time.perf_counter() - start
        sources = [Source(r.doc_id, r.source, r.chunk_index, r.chunk_id, score) for r, score in prepared.retrieved]
        return Answer(question, text.text, text.token_ids, sources, stats, prepared.prompt_ids)

    def _chunk_token_ids(self, row: ContextRow) -> tuple[int, ...]:
        if row.token_ids is not None:
            return row.token_ids
        # No KV for this profile (not computed yet): the text's ids, prefilled live.
        return tuple(encode_text(self.lm.tokenizer, row.text))

    def _load_stored(self, row: ContextRow, stats: Stats) -> list[torch.Tensor] | None:
        """The prefix and `row`'s chunk KV `[(L, 2, H, P, D), (L, 2, H, T, D)]`, verified; None
        (with a warning in `stats`) when either is missing or corrupt."""
        profile = self.active.profile
        try:
            prefix = self._load_prefix()
            if row.entry is None or row.token_ids is None:
                raise StoreCorruptError(f"chunk {row.chunk_id} has no stored KV for this model")
            if KVKey.for_chunk(profile, row.token_ids).to_string() != row.entry.kv_key:
                raise StoreCorruptError(f"chunk {row.chunk_id}'s stored KV key does not match its tokens")
            chunk = self.snapshot.shards.read(row.entry.shard, row.entry.tensor, row.entry.checksum)
            return [prefix, chunk.to(self.device)]
        except StoreCorruptError as exc:
            message = f"{exc}; answered with a full prefill instead"
            log.warning(message)
            stats.mode = "fallback"
            stats.warnings.append(message)
            return None

    def _load_prefix(self) -> torch.Tensor:
        if self._prefix_kv is None:
            key = KVKey.for_prefix(self.active.profile).to_string()
            entry = self.snapshot.catalog.entry(key)
            if entry is None:
                raise StoreCorruptError("the system-prompt KV is missing from the store")
            self._prefix_kv = self.snapshot.shards.read(entry.shard, entry.tensor, entry.checksum).to(self.device)
        return self._prefix_kv

    def _fit_budget(self, num_prompt_tokens: int, max_new_tokens: int, stats: Stats) -> int:
        room = self.lm.facts.max_context - num_prompt_tokens
        if room < 1:
            raise InputError(
                f"the prompt is {num_prompt_tokens} tokens, over the model's context of {self.lm.facts.max_context}; "
                "ask a shorter question or use a smaller --top-k"
            )
        if room < max_new_tokens:
            stats.warnings.append(f"max_new_tokens cut from {max_new_tokens} to {room} to fit the context")
        return min(room, max_new_tokens)

    def close(self) -> None:
        self.snapshot.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _ms(since: float) -> float:
    return (time.perf_counter() - since) * 1000.0
