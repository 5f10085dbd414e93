"""The online path: retrieve, load the stored KV as the prompt prefix, prefill only the rest,
generate. `QueryEngine` is what `ragkv.open()` returns and what the CLI's `ask` drives."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Generator, Sequence

import torch

from ragkv import assemble, codec, kv
from ragkv.assemble import Assembly
from ragkv.answer import Answer, AnswerStream, Savings, Source, Stats
from ragkv.config import KV_DTYPES, AskSettings, resolve_device, resolve_dtype
from ragkv.embed import Embedder
from ragkv.errors import InputError, ModelError, StoreCorruptError, StoreEmptyError
from ragkv.conversation import Conversation
from ragkv.forward import compute_chunks, shard_metadata
from ragkv.generate import generate, prefill
from ragkv.prefix_cache import PrefixCache
from ragkv.keys import KVKey, Profile
from ragkv.lru import ByteLRU
from ragkv.model import LoadedModel, load_model, model_name
from ragkv.prompt import PromptLayout, encode_text
from ragkv.text import check_text
from store import ContextRow, Hit, StoreSnapshot, open_snapshot
from store.popularity import HitLog, Use
from store.writeback import ComputedKV, WriteBack

if TYPE_CHECKING:  # the scheduler imports this module's neighbours; at run time it is imported on use
    from ragkv.scheduler import Batcher

log = logging.getLogger("ragkv")

MIN_ANSWER_TOKENS = 16  # a prompt must leave at least this much of the context to answer in
ROW_CACHE_ENTRIES = 100_000  # catalog rows kept per engine (small: text and token ids)


@dataclass(frozen=True)
class ActiveProfile:
    """The stored profile this engine answers with, checked against the live model."""

    profile: Profile
    layout: PromptLayout
    system_prompt: str


@dataclass
class Prompt:
    """A question's retrieved chunks and prompt ids: what `QueryEngine.prompt_for` returns."""

    retrieved: list[tuple[ContextRow, float]]  # the prompt's chunks, in prompt order, with their hit's score
    prompt_ids: list[int]  # the whole prompt
    question_ids: list[int]  # its tail: the question with its template
    chunk_ids: list[tuple[int, ...]]  # each retrieved chunk's token ids


@dataclass
class Prepared:
    """A question ready to prefill: what `QueryEngine.prepare` returns."""

    retrieved: list[tuple[ContextRow, float]]  # the prompt's chunks, in prompt order, with their hit's score
    prompt_ids: list[int]  # the whole prompt
    question_ids: list[int]  # its tail: the question with its template
    live_ids: list[int]  # the part to prefill now (after what the assembled cache holds)
    assembly: Assembly


class QueryEngine:
    """Answers questions from a store. Loads the model and embedder once; holds one published
    generation open (and leased) until `refresh()` moves it to a newer one or `close()`."""

    def __init__(self, store: Path | str, model: str | None = None, embedder: str | None = None,
                 device: str = "auto", dtype: str | None = None, kv_dtype: str | None = None,
                 prefix_cache_bytes: int = 512 << 20, ram_bytes: int = 1 << 30, write_back: bool = True,
                 weights: bool = True):
        if kv_dtype is not None and kv_dtype not in KV_DTYPES:
            raise InputError(f"unknown --kv-dtype {kv_dtype!r}; use one of {', '.join(KV_DTYPES)}")
        self.snapshot: StoreSnapshot = open_snapshot(store)
        try:
            meta = self.snapshot.catalog.meta()
            self.device = resolve_device(device)
            self.lm, self.active = self._load_model(model, dtype, kv_dtype, weights)
            self.embedder = self._load_embedder(embedder or meta["embedder"], meta)
        except BaseException:
            self.snapshot.close()
            raise
        self._prefix_kv: torch.Tensor | None = None  # pinned in memory after the first load
        self._separator: torch.Tensor | None = None
        self.prefix_cache = PrefixCache(prefix_cache_bytes)
        self.ram: ByteLRU[torch.Tensor] = ByteLRU(ram_bytes)  # hot chunk KV by key, verified when loaded
        self.savings = Savings()  # every answer's prefill accounting, since open
        self._row_cache: dict[int, ContextRow] = {}  # catalog rows of the open generation
        self._span_cache: dict[tuple[str, int], list[int]] = {}  # (doc, span start) -> its chunk ids
        self._read_buffers: list[torch.Tensor] = []  # stored KV is read into these (reused memory)
        self.write_back = write_back  # store KV computed on a miss (in the background, within the budget)
        self._write_back: WriteBack | None = None
        self._hit_log = None if self.snapshot.remote else HitLog(self.snapshot.root)

    # -- setup ----------------------------------------------------------------------------
    def _load_model(self, name: str | None, dtype: str | None, kv_dtype: str | None,
                    weights: bool = True) -> tuple[LoadedModel, ActiveProfile]:
        rows = self.snapshot.catalog.profiles()
        if not rows:
            raise StoreEmptyError(f"store {self.snapshot.location} holds no KV; add documents with: ragkv ingest DOCS")
        last = self.snapshot.catalog.meta().get("last_profile")
        default = next((r for r in rows if r["profile_id"] == last), rows[0])
        name = model_name(name) if name else default["model_name"]
        same_name = [r for r in rows if r["model_name"] == name]
        dtype = resolve_dtype(dtype, self.device) if dtype else (same_name[0]["dtype"] if same_name else default["dtype"])
        if kv_dtype is not None and not any(r["kv_quant"] == codec.kv_quant(kv_dtype, dtype) for r in same_name or rows):
            held = ", ".join(sorted({r["kv_quant"] for r in same_name or rows}))
            raise ModelError(f"store {self.snapshot.location} holds no KV stored as {kv_dtype} for {name} (it holds: "
                             f"{held}; 'none' is lossless); omit --kv-dtype, or ingest with --kv-dtype {kv_dtype}")
        lm = load_model(name, self.device, dtype, weights)
        candidates = [r for r in rows if r["model_fingerprint"] == lm.facts.fingerprint and r["dtype"] == dtype
                      and (kv_dtype is None or r["kv_quant"] == codec.kv_quant(kv_dtype, dtype))]
        if not candidates:
            held = ", ".join(sorted({f"{r['model_name']} ({r['dtype']}, KV {r['kv_quant']})" for r in rows}))
            raise ModelError(
                f"store {self.snapshot.location} has no KV for model {name} in {dtype}"
                f"{f' stored as {kv_dtype}' if kv_dtype else ''} (it holds: {held}); "
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
                f"model {name}'s tokenizer or chat template differs from when store {self.snapshot.location} was built; "
                "re-run ragkv ingest to recompute the KV"
            )
        return lm, ActiveProfile(profile, layout, row["system_prompt"])

    def _load_embedder(self, name: str, meta: dict) -> Embedder:
        embedder = Embedder.load(name, self.device)
        if embedder.fingerprint != meta.get("embedder_fingerprint"):
            raise ModelError(
                f"embedder {name} differs from the one store {self.snapshot.location} was built with "
                f"({meta.get('embedder')}); omit --embedder"
            )
        return embedder

    def refresh(self) -> bool:
        """Switch to the store's newest published generation if there is one (between
        questions: an answer always comes from one generation). Returns whether it switched."""
        if self.snapshot.latest_generation() == self.snapshot.generation:
            return False
        snapshot = open_snapshot(self.snapshot.location)
        profile_id = self.active.profile.profile_id
        if all(p["profile_id"] != profile_id for p in snapshot.catalog.profiles()):
            snapshot.close()
            raise ModelError(f"the store's new generation no longer holds KV for model {self.lm.facts.name}; reopen it")
        self.snapshot.close()
        self.snapshot = snapshot
        self._row_cache.clear()
        self._span_cache.clear()
        return True

    # -- the query path -------------------------------------------------------------------
    def retrieve(self, question: str, top_k: int = 1, doc_ids: Sequence[str] | None = None,
                 context: str = "chunk") -> list[tuple[ContextRow, float]]:
        """The `top_k` chunks nearest to `question`, best first, with their cosine scores;
        only chunks of the documents `doc_ids` when given. With `context` "span" or
        "document", the prompt's chunks around them instead (see `widen`)."""
        return self.widen(self._rows(self._search(question, top_k, doc_ids)), context)

    def widen(self, hits: list[tuple[ContextRow, float]], context: str) -> list[tuple[ContextRow, float]]:
        """The chunks a prompt holds for `hits`. "chunk": the hits themselves. "span": each hit
        with the chunks of its span before it (a span: a document's chunks whose KV was
        computed as one sequence, `ingest --span-tokens`); "document": each hit's whole span.
        Hits in one span merge into one run of its chunks, in document order, placed at its
        best hit's rank and carrying its score. A chunk stored on its own is its own span."""
        if context == "chunk":
            return hits
        runs: dict[tuple[str, int], tuple[int, float, list[int]]] = {}  # (doc, start) -> (last index, score, ids)
        for row, score in hits:
            if row.span_start is None:
                runs.setdefault((row.doc_id, row.chunk_index), (row.chunk_index, score, [row.chunk_id]))
                continue
            key = (row.doc_id, row.span_start)
            last, best, _ = runs.get(key, (row.chunk_index, score, []))
            runs[key] = (max(last, row.chunk_index), max(best, score), self._span_ids(row))
        widened: list[tuple[ContextRow, float]] = []
        for (doc_id, start), (last, score, chunk_ids) in runs.items():
            rows = [r for r, _ in self._rows([Hit(i, score) for i in chunk_ids])]
            if context == "span":
                rows = [r for r in rows if r.chunk_index <= last]
            widened += [(r, score) for r in rows]
        return widened

    def _span_ids(self, row: ContextRow) -> list[int]:
        key = (row.doc_id, row.span_start)
        if key not in self._span_cache:
            self._span_cache[key] = self.snapshot.catalog.span_chunk_ids(
                self.active.profile.profile_id, row.doc_id, row.span_start)
        return self._span_cache[key]

    def _search(self, question: str, top_k: int, doc_ids: Sequence[str] | None) -> list[Hit]:
        check_text(question)
        allowed = None
        if doc_ids is not None:
            allowed = []
            for doc_id in doc_ids:
                chunk_ids = self.snapshot.catalog.chunk_ids_of(doc_id)
                if not chunk_ids:
                    raise InputError(f"no document {doc_id!r} in the store")
                allowed += chunk_ids
        return self.snapshot.vectors.search(self.embedder.embed([question])[0], top_k, allowed)

    def _rows(self, hits: list[Hit]) -> list[tuple[ContextRow, float]]:
        """Catalog rows of the hits; rows are immutable within a generation, so they are kept."""
        missing = [h.chunk_id for h in hits if h.chunk_id not in self._row_cache]
        if missing:
            if len(self._row_cache) > ROW_CACHE_ENTRIES:
                self._row_cache.clear()
            for row in self.snapshot.catalog.context_rows(self.active.profile.profile_id, missing):
                self._row_cache[row.chunk_id] = row
        return [(self._row_cache[h.chunk_id], h.score) for h in hits if h.chunk_id in self._row_cache]

    def ask(self, question: str, settings: AskSettings | None = None, **options) -> Answer:
        """Answer `question` (options as in `AskSettings`: top_k, max_new_tokens, use_cache, mode)."""
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

    def batched(self, **settings) -> "Batcher":
        """A continuous-batching front for this engine (settings as in `BatchSettings`:
        max_batch, max_batch_tokens, prefill_chunk, max_queue). Call its `ask` from many
        threads: their answers decode together, each equal to asking alone (float32). While
        it is open it owns the model: use it, not this engine's own `ask`. Close it (or use
        `with`) to stop its model thread."""
        from ragkv.scheduler import BatchSettings, Batcher

        return Batcher(self, BatchSettings(**settings))

    def conversation(self, settings: AskSettings | None = None, **options) -> Conversation:
        """A multi-turn conversation: its first message retrieves, later ones reuse the cache."""
        return Conversation(self, settings or AskSettings.from_dict(options))

    def first_token_logits(self, question: str, settings: AskSettings | None = None, **options) -> torch.Tensor:
        """The next-token logits `(V,)` after the prompt, as `ask` would see them (for comparing
        the cached path with a full prefill: exactness tests, fidelity evaluations)."""
        settings = settings or AskSettings.from_dict(options)
        prepared = self.prepare(question, settings, _new_stats(settings))
        return prefill(prepared.assembly.attending(self.lm.model), prepared.live_ids, prepared.assembly.cache).float()

    def _answer(self, question: str, settings: AskSettings) -> Generator[str, None, Answer]:
        start = time.perf_counter()
        stats = _new_stats(settings, self.snapshot.generation)
        prepared = self.prepare(question, settings, stats)
        max_new_tokens = self.fit_budget(len(prepared.prompt_ids), settings.max_new_tokens, stats)
        done = yield from generate(prepared.assembly.attending(self.lm.model), self.lm.tokenizer,
                                   prepared.assembly.cache, prepared.live_ids,
                                   self.lm.facts.eos_ids, max_new_tokens, start, prepared.assembly.after_prefill,
                                   settings.decoding)
        stats.record(done, start)
        self.savings.add(stats)
        sources = [Source(r.doc_id, r.source, r.chunk_index, r.chunk_id, score) for r, score in prepared.retrieved]
        return Answer(question, done.text, done.token_ids, sources, stats, prepared.prompt_ids)

    def prepare(self, question: str, settings: AskSettings, stats: Stats) -> "Prepared":
        """Retrieve (widened to `settings.context`), build the prompt ids, and assemble what the
        store holds of the prompt into a cache: the one seam every online path (ask, stream,
        conversations, the batcher, the service) builds its prompt through. Fills `stats`."""
        prompt = self.prompt_for(question, settings, stats)
        retrieved, prompt_ids, question_ids = prompt.retrieved, prompt.prompt_ids, prompt.question_ids
        chunk_ids = prompt.chunk_ids
        load_start = time.perf_counter()
        assembly = self.assemble([row for row, _ in retrieved], chunk_ids, settings, stats)
        stats.kv_load_ms = _ms(load_start)
        live_ids = prompt_ids[assembly.num_cached:]
        self._record_uses(retrieved, stats)
        computed = sum(len(ids) for (row, _), ids in zip(retrieved, chunk_ids)
                       if stats.kv_sources.get(row.chunk_id) == "computed")  # prefilled now, as a miss
        stats.reused_tokens = assembly.reused_tokens - computed
        stats.recomputed_tokens = assembly.recomputed_tokens
        stats.prefix_cache_tokens = assembly.prefix_cache_tokens
        stats.computed_tokens = len(live_ids) + computed
        return Prepared(retrieved, prompt_ids, question_ids, live_ids, assembly)

    def prompt_for(self, question: str, settings: AskSettings, stats: Stats) -> "Prompt":
        """Retrieve (widened to `settings.context`, cut to fit the context) and lay out the
        prompt's ids. Needs no model weights: a front for
        another engine (ragkv.vllm_front) sends these ids. Fills `stats`' retrieval timings."""
        start = time.perf_counter()
        layout = self.active.layout
        given = settings.chunks is not None  # the caller retrieved (a framework's retriever): no search
        if given:
            check_text(question)
        hits = [Hit(*chunk) for chunk in settings.chunks] if given else self._search(question, settings.top_k,
                                                                                   settings.doc_ids)
        stats.retrieval_ms = _ms(start)
        catalog_start = time.perf_counter()
        retrieved = self._rows(hits)
        stats.catalog_ms = _ms(catalog_start)
        if given and len(retrieved) < len(hits):
            raise InputError(f"{len(hits) - len(retrieved)} of the given chunks are not in store "
                             f"{self.snapshot.location} (generation {self.snapshot.generation}): retrieve again")
        if not retrieved and not settings.passages:
            raise StoreEmptyError(f"store {self.snapshot.location} returned no chunks for the question")
        if not given and len(retrieved) < settings.top_k:
            stats.warnings.append(f"top_k {settings.top_k} but the store holds {len(retrieved)} chunks")
        retrieved = self.widen(retrieved, settings.context) + _live_rows(settings.passages, stats)
        question_ids = layout.question_ids(self.lm.tokenizer, question)
        retrieved = self._fit_chunks(retrieved, question_ids, stats)
        chunk_ids = [self.chunk_token_ids(row) for row, _ in retrieved]
        return Prompt(retrieved, layout.prompt_ids(chunk_ids, question_ids), question_ids, chunk_ids)

    def _fit_chunks(self, retrieved, question_ids: list[int], stats: Stats):
        """Drop the last chunks (the lowest-ranked hits, or a span's last chunks: cut at chunk
        boundaries) until the prompt leaves room to answer."""
        room = self.lm.facts.max_context - MIN_ANSWER_TOKENS
        layout = self.active.layout
        before = len(retrieved)
        while len(retrieved) > 1 and len(layout.prompt_ids(
                [self.chunk_token_ids(r) for r, _ in retrieved], question_ids)) > room:
            retrieved = retrieved[:-1]
        if len(retrieved) < before:
            stats.warnings.append(f"context cut from {before} to {len(retrieved)} chunks: more do not fit the model's "
                                  "context")
        return retrieved

    def assemble(self, rows: list[ContextRow], chunk_ids: list[tuple[int, ...]], settings: AskSettings,
                 stats: Stats) -> Assembly:
        """The cache a prompt over `rows` (their token ids: `chunk_ids`) starts from, per
        `settings.mode`: what the store holds of it, loaded and verified (see ragkv.assemble)."""
        model = self.lm.model
        if not settings.use_cache:
            return Assembly(kv.to_cache_empty(model.config))
        stats.kv_quant = self.active.profile.kv_quant
        runs = stored_runs(rows)
        if rows[0].live:  # nothing stored comes first: the whole prompt is prefilled (exact)
            return Assembly(kv.to_cache_empty(model.config))
        if settings.mode != "exact" and any(row.live for row in rows):
            stats.warnings.append(f"--mode {settings.mode} composes stored KV; passages given as text have none, so "
                                  "the prompt was answered with a full prefill instead")
            stats.mode = "fallback"
            return Assembly(kv.to_cache_empty(model.config))
        if not rows[runs[0][0]].starts_span:
            stats.warnings.append(f"chunk {rows[0].chunk_index} of {rows[0].doc_id} continues a span: its KV holds the "
                                  "chunks before it, so it is prefilled live (ask with --context span)")
            return Assembly(kv.to_cache_empty(model.config))
        if settings.mode != "exact" and not all(rows[run[0]].starts_span for run in runs):
            stats.warnings.append(f"--mode {settings.mode} needs every chunk's span from its start; "
                                  "answered with a full prefill instead (ask with --context span)")
            stats.mode = "fallback"
            return Assembly(kv.to_cache_empty(model.config))
        loaded = runs[:1] if settings.mode == "exact" else runs
        read_start = time.perf_counter()
        stored = self._load_stored([[rows[i] for i in run] for run in loaded], stats)
        stats.kv_read_ms = _ms(read_start)
        if stored is None:
            return Assembly(kv.to_cache_empty(model.config))
        assemble_start = time.perf_counter()
        assembly = self._assemble_mode(stored, rows, runs, chunk_ids, settings)
        stats.assemble_ms = _ms(assemble_start)
        return assembly

    def _assemble_mode(self, stored: list[torch.Tensor], rows: list[ContextRow], runs: list[list[int]], chunk_ids,
                       settings) -> Assembly:
        """`stored`: the prefix KV, then one KV per loaded run (its chunks' entries joined)."""
        model = self.lm.model
        prefix, pieces_kv = stored[0], stored[1:]
        separator = list(self.active.layout.separator_ids)
        if settings.mode == "exact":
            after = len(runs[0])
            segments = [separator + list(ids) for ids in chunk_ids[after:]]
            last = rows[after - 1]
            key = last.entry.kv_key if last.entry else KVKey.for_chunk(self.active.profile, chunk_ids[after - 1]).to_string()
            return assemble.exact(model, stored, segments, self.prefix_cache, key)
        pieces = [pieces_kv[0]]
        for piece in pieces_kv[1:]:
            pieces += [self._separator_kv(), piece]
        if settings.mode == "concat":
            return assemble.concat(model, prefix, pieces)
        context_ids = [*self.active.layout.prefix_ids, *self.active.layout.context_ids(chunk_ids)]
        if settings.mode == "epic":
            return assemble.epic(model, prefix, pieces, context_ids, settings.blend_ratio)
        if settings.mode == "ape":
            return assemble.ape(model, prefix, pieces, settings.ape_temperature, settings.ape_scale)
        return assemble.blended(model, prefix, pieces, context_ids, settings.blend_ratio)

    def chunk_token_ids(self, row: ContextRow) -> tuple[int, ...]:
        """The token ids of a chunk in the prompt (stored with its KV, else its text's)."""
        if row.token_ids is not None:
            return row.token_ids
        # No KV for this profile (not computed yet): the text's ids, prefilled live.
        return tuple(encode_text(self.lm.tokenizer, row.text))

    def _load_stored(self, runs: list[list[ContextRow]], stats: Stats) -> list[torch.Tensor] | None:
        """The prefix KV and each run's KV (its chunks' entries joined along the tokens),
        `[(L, 2, H, P, D), (L, 2, H, T_run, D)...]`, every entry's key checked against the
        tokens before it and its bytes verified; None (with a warning in `stats`) when any
        is missing or corrupt."""
        profile = self.active.profile
        separator = self.active.layout.separator_ids
        try:
            loaded = [self._load_prefix()]
            slot, ram_hits = 0, stats.ram_hits
            for run in runs:
                parts, key = [], None
                for row in run:
                    if row.entry is None and row.span_start is None and len(run) == 1:
                        parts.append(self._computed_kv(row, stats))  # a miss: compute it now
                        continue
                    if row.entry is None or row.token_ids is None:
                        raise StoreCorruptError(f"chunk {row.chunk_id} has no stored KV for this model")
                    key = KVKey.for_chunk(profile, row.token_ids) if key is None else \
                        key.then((*separator, *row.token_ids))
                    if key.to_string() != row.entry.kv_key:
                        raise StoreCorruptError(f"chunk {row.chunk_id}'s stored KV key does not match its tokens")
                    parts.append(self._chunk_kv(row.entry, stats, slot))
                    stats.kv_sources[row.chunk_id] = "ram" if stats.ram_hits > ram_hits else "store"
                    ram_hits = stats.ram_hits
                    slot += 1
                loaded.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=kv.TOKEN_DIM))
            return loaded
        except StoreCorruptError as exc:
            message = f"{exc}; answered with a full prefill instead"
            log.warning(message)
            stats.mode = "fallback"
            stats.warnings.append(message)
            return None

    def _chunk_kv(self, entry, stats: Stats, slot: int) -> torch.Tensor:
        """A chunk's KV from the RAM tier, else read (and verified) from its shard into read
        buffer `slot` (valid until the next request assembles), then kept in the RAM tier."""
        kv_tensor = self.ram.get(entry.kv_key)
        if kv_tensor is not None:
            stats.ram_hits += 1
            return kv_tensor
        stats.ram_misses += 1
        buffer = self._read_buffer(slot, entry.nbytes + 64) if entry.nbytes else None  # + alignment of parts
        parts = self.snapshot.shards.read_parts(entry.shard, entry.tensor, entry.checksum, out=buffer)
        # From pinned host memory the copy to the GPU is asynchronous; the prefill that uses
        # the KV runs after it on the same stream, and its first token synchronises.
        parts = {name: t.to(self.device, non_blocking=True) for name, t in parts.items()}
        kv_tensor = codec.decode(parts, self.lm.model.dtype)
        if kv_tensor.numel() * kv_tensor.element_size() <= self.ram.max_bytes:
            kv_tensor = kv_tensor.clone() if kv_tensor.device.type == "cpu" else kv_tensor  # own memory
            self.ram.put(entry.kv_key, kv_tensor)
        return kv_tensor

    def _computed_kv(self, row: ContextRow, stats: Stats) -> torch.Tensor:
        """The KV of a chunk the store has none for, `(L, 2, H, T, D)`: from the RAM tier if
        computed earlier, else computed now after the prefix, exactly as ingest would (and
        passed through the store's codec, so it equals what a later store read returns).
        Kept in the RAM tier and handed to the background write-back."""
        profile = self.active.profile
        token_ids = self.chunk_token_ids(row)
        key = KVKey.for_chunk(profile, token_ids).to_string()
        kv_tensor = self.ram.get(key)
        if kv_tensor is not None:
            stats.ram_hits += 1
            stats.kv_sources[row.chunk_id] = "ram"
            return kv_tensor
        start = time.perf_counter()
        (result,) = compute_chunks(self.lm.model, self._load_prefix(), [list(token_ids)], len(token_ids),
                                   self.lm.pad_id)
        parts = codec.encode(result.kv, profile.kv_quant)
        kv_tensor = codec.decode({name: t.to(self.device) for name, t in parts.items()}, self.lm.model.dtype)
        stats.kv_compute_ms += _ms(start)
        stats.kv_sources[row.chunk_id] = "computed"
        self.ram.put(key, kv_tensor)
        writer = self._writer()
        if writer is not None:
            writer.submit(ComputedKV(profile.profile_id, key, row.chunk_id, token_ids, parts,
                                     shard_metadata(profile.profile_id, self.lm.facts.name, profile.dtype)))
        return kv_tensor

    def _writer(self) -> WriteBack | None:
        """The background write-back (started on the first miss), or None when off (the
        engine was opened with write_back=False, or the store is on S3)."""
        if self._write_back is None and self.write_back and not self.snapshot.remote:
            self._write_back = WriteBack(self.snapshot.root)
        return self._write_back

    def _record_uses(self, retrieved: list[tuple[ContextRow, float]], stats: Stats) -> None:
        """Log each chunk the prompt used, with where its KV came from (popularity, hit rate)."""
        if self._hit_log is None:
            return
        try:
            self._hit_log.record(Use(row.doc_id, row.chunk_index, stats.kv_sources.get(row.chunk_id, "live"))
                                 for row, _ in retrieved if not row.live)
        except OSError as exc:  # a read-only store still answers; it only stops counting
            log.warning("cannot log chunk uses in %s (%s); popularity is not counted for this engine",
                        self.snapshot.location, exc.strerror or exc)
            self._hit_log = None

    def _read_buffer(self, slot: int, size: int) -> torch.Tensor:
        """Reused host memory to read stored KV into: one buffer per chunk of a request,
        page-locked when the model is on a GPU (so the host-to-device copy can overlap)."""
        while len(self._read_buffers) <= slot:
            self._read_buffers.append(torch.empty(0, dtype=torch.uint8))
        if self._read_buffers[slot].numel() < size:
            pinned = torch.device(self.device).type == "cuda"
            self._read_buffers[slot] = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
        return self._read_buffers[slot]

    def _load_prefix(self) -> torch.Tensor:
        if self._prefix_kv is None:
            key = KVKey.for_prefix(self.active.profile).to_string()
            entry = self.snapshot.catalog.entry(key)
            if entry is None:
                raise StoreCorruptError("the system-prompt KV is missing from the store")
            parts = self.snapshot.shards.read_parts(entry.shard, entry.tensor, entry.checksum)
            self._prefix_kv = codec.decode(parts, self.lm.model.dtype).to(self.device)
        return self._prefix_kv

    def _separator_kv(self) -> torch.Tensor:
        """KV of the chunk separator computed right after the prefix, like a stored chunk."""
        if self._separator is None:
            separator = list(self.active.layout.separator_ids)
            (result,) = compute_chunks(self.lm.model, self._load_prefix(), [separator], len(separator), self.lm.pad_id)
            self._separator = result.kv.to(self.device)
        return self._separator

    def fit_budget(self, num_prompt_tokens: int, max_new_tokens: int, stats: Stats) -> int:
        """How many tokens an answer after `num_prompt_tokens` may have (at most `max_new_tokens`)."""
        room = self.lm.facts.max_context - num_prompt_tokens
        if room < 1:
            raise InputError(
                f"the prompt is {num_prompt_tokens} tokens, over the model's context of {self.lm.facts.max_context}; "
                "ask a shorter question or use a smaller --top-k"
            )
        if room < max_new_tokens:
            stats.warnings.append(f"max_new_tokens cut from {max_new_tokens} to {room} to fit the context")
        return min(room, max_new_tokens)

    def flush(self) -> None:
        """Wait until KV computed on misses so far is written to the store (or given up)."""
        if self._write_back is not None:
            self._write_back.flush()

    def close(self) -> None:
        """Finish the write-back, then release the store."""
        if self._write_back is not None:
            self._write_back.close()
        if self._hit_log is not None:
            self._hit_log.close()
        self.snapshot.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _live_rows(passages: Sequence[str], stats: Stats) -> list[tuple[ContextRow, float]]:
    """Passages given as text (no ragkv identity: another retriever's) as prompt chunks that are
    always prefilled, never looked up or stored. Their chunk ids are -1, -2, ... for passage 0,
    1, ... (stored chunks' ids are never negative), so a Source names the passage it was."""
    if passages:
        stats.warnings.append(f"{len(passages)} passages without ragkv identity were prefilled live")
    return [(ContextRow(-1 - i, f"passage-{i}", f"(passage {i}, given as text)", 0, text, None, None, live=True), 0.0)
            for i, text in enumerate(passages)]


def _new_stats(settings: AskSettings, generation: int = 0) -> Stats:
    return Stats(mode=settings.mode if settings.use_cache else "full", store_generation=generation)


def _ms(since: float) -> float:
    return (time.perf_counter() - since) * 1000.0


def stored_runs(rows: Sequence[ContextRow]) -> list[list[int]]:
    """Indices of `rows` grouped into runs whose KV loads as one sequence: a chunk stored on
    its own or a span's first chunk, then the chunks that continue that span, in order."""
    runs: list[list[int]] = []
    for i, row in enumerate(rows):
        previous = rows[i - 1] if i else None
        continues = (previous is not None and not row.starts_span and row.span_start is not None
                     and previous.doc_id == row.doc_id and previous.span_start == row.span_start
                     and row.chunk_index == previous.chunk_index + 1)
        if continues:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs
