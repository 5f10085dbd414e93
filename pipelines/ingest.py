"""`ingest`: read → chunk → plan → embed → compute KV → write shards → publish a generation.

Embedding and KV run in this process (`engine="local"`) or as a Ray Data job
(`engine="ray"`, see ragkv.pipelines.engines.ray_engine); reading, chunking and planning always run here,
against the catalog, so both engines build the same store.

Idempotent: a document whose content and chunking are unchanged is not chunked or embedded
again, and a chunk whose KV key is already in the store is not computed again.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ragkv.core.config import IngestSettings, ModelSettings
from ragkv.core.cpu import run_aside
from ragkv.core.errors import InputError, ModelError
from ragkv.core.keys import Profile
from ragkv.kv import cache as kv
from ragkv.kv import codec
from ragkv.model import self_check
from ragkv.model.embed import Embedder
from ragkv.model.forward import compute_prefix, compute_spans, shard_metadata
from ragkv.model.llm import LoadedModel, load_model
from ragkv.model.prompt import PromptLayout
from ragkv.model.self_check import SelfCheck
from ragkv.pipelines.engines import ray_engine, vllm_engine
from ragkv.pipelines.engines.ray_ingest import RayJob, run_ray_job
from ragkv.pipelines.pending import PendingChunk, Unit, pending_alone, pending_spans, plan_work, within_budget
from ragkv.pipelines.plan import DocumentPlan, content_hash, plan_documents
from ragkv.pipelines.progress import Reporter
from ragkv.pipelines.reading.chunk import Chunk, chunk_blocks, chunk_text, chunking_id
from ragkv.pipelines.reading.read import Document, Skipped, read_documents
from ragkv.pipelines.stored_kv import StoredKV
from ragkv.store import ChunkRow, DocumentRow, StoreWriter
from ragkv.store.catalog import ChunkLink, ProfileRow
from ragkv.store.kv import budget
from ragkv.store.kv.writeback import fold_pending
from ragkv.store.writer import open_writer

ENGINES = ("local", "ray", "vllm")
ROOM_FOR_QUESTION = 64  # tokens a chunk must leave free in the context for question and answer


@dataclass
class IngestReport:
    store: str
    generation: int = 0
    model: str = ""
    dtype: str = ""
    device: str = ""
    engine: str = "local"
    documents: dict[str, int] = field(default_factory=lambda: {"added": 0, "changed": 0, "unchanged": 0, "removed": 0})
    chunks_embedded: int = 0
    kv_computed: int = 0  # KV entries computed now
    kv_reused: int = 0  # chunks whose KV was already stored (unchanged, or identical text)
    kv_adopted: int = 0  # entries sealed by an earlier, interrupted run, verified and kept
    kv_deferred: int = 0  # chunks left without KV (budget or --precompute): computed on their first miss
    kv_evicted: int = 0  # stored chunk KV the budget dropped for more popular chunks
    kv_budget: int | None = None  # bytes the store's KV may take (None: no budget)
    kv_bytes: int = 0  # bytes the store's KV takes now
    uses_folded: int = 0  # question uses read from the hit logs into the catalog (popularity)
    kv_folded: int = 0  # KV readers computed on misses and left pending (on S3), stored by this ingest
    shards_discarded: int = 0  # ray: shards of killed, retried attempts (duplicates), deleted
    calibration: str = ""  # with --calibrate: what --mode approximate runs as now, and what it measured
    tokens_computed: int = 0
    tokens_skipped: int = 0
    compute_s: float = 0.0  # model forwards only
    total_s: float = 0.0
    skipped: list[Skipped] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_computed / self.compute_s if self.compute_s else 0.0

    def to_dict(self) -> dict:
        out = asdict(self)
        out["tokens_per_s"] = round(self.tokens_per_s, 1)
        out["skipped"] = [asdict(s) for s in self.skipped]
        return out


def ingest(
    paths: Sequence[Path | str],
    store: Path | str,
    model: ModelSettings | None = None,
    settings: IngestSettings | None = None,
    reporter: Reporter | None = None,
    wait: bool = False,
    prune: bool = False,
    engine: str = "local",
    workers: int = 0,
) -> IngestReport:
    """Ingest documents under `paths` into the store at `store` (a folder or s3://bucket/prefix)
    and publish a new generation.

    With `prune`, `paths` are the whole corpus: stored documents not found there are removed.
    `engine="ray"` embeds and computes KV in a Ray Data job (`workers` actors; 0: one per GPU,
    else one per 2 CPUs) instead of in this process; the store it builds is the same.
    Nothing is written unless documents were found and the model loaded; on any error the
    published store is left exactly as it was.
    """
    started = time.perf_counter()
    model = model or ModelSettings()
    settings = settings or IngestSettings()
    reporter = reporter or Reporter()
    found = read_documents(paths, settings.max_document_bytes)
    if not found.documents:
        reasons = "; ".join(f"{s.source}: {s.reason}" for s in found.skipped[:3]) or "no files"
        raise InputError(f"no documents to ingest under {', '.join(map(str, paths))} ({reasons})")
    settings = _for_engine(engine, store, settings)
    job = RayJob(*ray_engine.connect(workers), model=model) if engine == "ray" else None
    here = "cpu" if job else model.device  # with Ray, this process only plans: the workers compute
    lm = load_model(model.model, here, model.dtype)
    embedder = Embedder.load(model.embedder, here)
    layout = PromptLayout.build(lm.tokenizer, settings.system_prompt)
    _check_fits(lm, layout, settings.chunk_tokens, "--chunk-tokens")
    _check_fits(lm, layout, settings.span_tokens, "--span-tokens")
    quant = codec.kv_quant(settings.kv_dtype, model.dtype)
    facts = lm.facts
    profile = Profile.of_layout(
        facts.fingerprint, facts.tokenizer_fingerprint, layout, model.dtype, quant, facts.kv_layout_key
    )
    report = IngestReport(
        str(store), model=lm.facts.name, dtype=model.dtype, device=model.device, engine=engine, skipped=found.skipped
    )
    to_vllm: list[Unit] | None = [] if engine == "vllm" else None  # what vLLM computes after the publish
    try:
        with open_writer(store, wait=wait) as writer:
            report.kv_adopted = len(writer.adopt_orphans())
            folded = fold_pending(writer)  # what readers left: their KV computed on misses, their hit logs
            report.uses_folded, report.kv_folded = folded.uses_folded, folded.stored
            _write(
                writer, found.documents, lm, embedder, layout, profile, settings, reporter, report, prune, job, to_vllm
            )
            report.kv_bytes = writer.catalog.reports.kv_bytes()
            report.generation = writer.publish()
            folded.delete_folded()
            if job or report.kv_evicted:  # shards of killed, retried attempts (duplicates), or evicted KV
                report.shards_discarded = writer.delete_unreferenced_shards()[0]
    finally:
        reporter.done()
    if to_vllm is not None:
        vllm_engine.fill(store, lm.facts.path, model.dtype, to_vllm, report)
    if settings.calibrate:
        from ragkv.pipelines.calibrate import CalibrateSettings, calibrate

        del lm, embedder  # the calibration loads the model it answers with
        calibrated = calibrate(store, CalibrateSettings(), reporter, device=model.device)  # the profile just built
        report.calibration = calibrated.describe()
    report.total_s = time.perf_counter() - started
    return report


def _chunk_room(lm: LoadedModel, layout: PromptLayout) -> int:
    """Most tokens a chunk may have: the context less the prefix and room to ask and answer."""
    return lm.facts.max_context - len(layout.prefix_ids) - ROOM_FOR_QUESTION


def _for_engine(engine: str, store: Path | str, settings: IngestSettings) -> IngestSettings:
    """`settings` checked against the engine that computes the KV (and, for vLLM, the store)."""
    if engine not in ENGINES:
        raise InputError(f"unknown --engine {engine!r}; use one of {', '.join(ENGINES)}")
    if engine == "ray" and settings.span_tokens:
        raise InputError("--span-tokens runs with --engine local or vllm (the Ray job computes chunks one by one)")
    if engine == "vllm":
        vllm_engine.check(store, settings)
    return settings


def _check_fits(lm: LoadedModel, layout: PromptLayout, tokens: int, option: str) -> None:
    """`option`'s `tokens` (of a chunk or a span) fit the model's context after the prefix."""
    if tokens > _chunk_room(lm, layout):
        raise InputError(
            f"{option} {tokens} does not fit the model's context of {lm.facts.max_context} tokens "
            f"with the {len(layout.prefix_ids)}-token system prompt; use at most {_chunk_room(lm, layout)}"
        )


def _check_chunks_fit(pending: list[PendingChunk], lm: LoadedModel, layout: PromptLayout) -> None:
    """Chunks cut under another tokenizer may count differently under this one."""
    room = _chunk_room(lm, layout)
    longest = max((len(p.token_ids) for p in pending), default=0)
    if longest > room:
        raise InputError(
            f"a stored chunk is {longest} tokens for model {lm.facts.name}, more than its context leaves "
            f"room for ({room}); re-chunk with a smaller --chunk-tokens"
        )


def _write(
    writer: StoreWriter,
    documents: list[Document],
    lm: LoadedModel,
    embedder: Embedder,
    layout: PromptLayout,
    profile: Profile,
    settings: IngestSettings,
    reporter: Reporter,
    report: IngestReport,
    prune: bool,
    job: RayJob | None,
    to_vllm: list[Unit] | None = None,
) -> None:
    """Ingest `documents` into the store `writer` holds. The chunks' KV is computed here, by the
    Ray `job`, or, given `to_vllm`, left out and its planned units appended there (vLLM computes
    them after the publish; only chunks whose KV is stored, and spans, are linked till then)."""
    catalog = writer.catalog
    _check_embedder(writer, embedder)
    spans_part = f";span={settings.span_tokens}" if settings.span_tokens else ""

    def chunking(doc: Document) -> str:
        return chunking_id(settings.chunk_tokens, bool(doc.blocks)) + spans_part

    plan = plan_documents(documents, catalog.documents.all(), chunking, prune)
    report.skipped += plan.conflicts
    report.documents = plan.counts()
    new_chunks = _replace_documents(writer, plan, chunking, lm, settings, reporter)
    vectors = writer.ensure_vectors(embedder.dim)
    report.chunks_embedded = len(new_chunks)

    pending = _unlinked(catalog, plan, new_chunks, lm, layout, profile, settings, report)
    _check_chunks_fit(pending, lm, layout)
    if catalog.entries.profile(profile.profile_id) is None:  # a new profile: its self-test first (raises)
        check = run_aside(self_check.check_loaded, lm)
        catalog.entries.add_profile(_profile_row(profile, lm, settings.system_prompt, check))
    limit = settings.kv_budget if settings.kv_budget is not None else catalog.usage.kv_budget()
    # a span's chunks are all linked, KV or not: the link keeps each one's key and place
    links = pending if settings.span_tokens else None
    pending = _admitted(writer, pending, lm, profile, limit, settings, report)
    links = pending if links is None else links
    todo = plan_work(catalog, pending, profile)
    work, prefix_key = todo.units, todo.prefix_key
    report.kv_reused += todo.num_reused
    report.tokens_skipped += todo.tokens_reused
    if job:
        chunks = [u.chunks[0] for u in work]  # without spans every unit is one chunk
        done = run_ray_job(job, writer, new_chunks, chunks, prefix_key, lm, profile, settings, vectors, reporter)
        report.kv_computed += done.kv_computed
        report.tokens_computed += done.tokens_computed
        report.compute_s = done.compute_s
    else:
        _embed(new_chunks, embedder, vectors, reporter)
        if to_vllm is not None:  # the prefix here; the chunks in vLLM, after the publish
            _compute_and_store(writer, [], prefix_key, lm, profile, settings, reporter, report)
            to_vllm += work
            later = {c.key for u in work for c, new in zip(u.chunks, u.store, strict=True) if new}
            report.kv_deferred += len(later)
            links = links if settings.span_tokens else [p for p in links if p.key not in later]
        else:
            _compute_and_store(writer, work, prefix_key, lm, profile, settings, reporter, report)
    catalog.entries.link_chunks(
        profile.profile_id, [ChunkLink(p.chunk_id, p.key, p.token_ids, p.span_start) for p in links]
    )
    if limit is not None:  # estimates planned the work; the bytes written decide
        report.kv_evicted += len(budget.enforce(writer, profile.profile_id, limit))
        catalog.set_meta({"kv_budget": str(limit)})
    catalog.set_meta(
        {
            "embedder": embedder.name,
            "embedder_fingerprint": embedder.fingerprint,
            "last_profile": profile.profile_id,
        }
    )


def _admitted(
    writer: StoreWriter,
    pending: list[PendingChunk],
    lm: LoadedModel,
    profile: Profile,
    limit: int | None,
    settings: IngestSettings,
    report: IngestReport,
) -> list[PendingChunk]:
    """The pending chunks whose KV is computed now: all of them, or, under a KV budget (`limit`)
    or a --precompute limit, those that earn a place (others' KV is evicted or deferred)."""
    report.kv_budget = limit
    if limit is None and settings.precompute is None:
        return pending
    admitted = within_budget(writer, pending, lm, profile, limit, settings.precompute)
    report.kv_evicted += admitted.num_evicted
    report.kv_deferred = admitted.num_deferred
    return admitted.pending


def _check_embedder(writer: StoreWriter, embedder: Embedder) -> None:
    meta = writer.catalog.meta()
    if meta.get("embedder_fingerprint", embedder.fingerprint) != embedder.fingerprint:
        raise ModelError(
            f"store {writer.root} was built with embedder {meta.get('embedder')}; "
            f"ingest with --embedder {meta.get('embedder')} or use a new store"
        )


def _unlinked(
    catalog,
    plan: DocumentPlan,
    new_chunks: list[ChunkRow],
    lm: LoadedModel,
    layout: PromptLayout,
    profile: Profile,
    settings: IngestSettings,
    report: IngestReport,
) -> list[PendingChunk]:
    """Every chunk without a link under this profile, keyed (only keys not stored yet are
    computed, later); the linked chunks of unchanged documents are counted as reused."""
    unchanged_ids = [d.doc_id for d in plan.unchanged]
    linked = catalog.entries.linked_chunk_ids(profile.profile_id)
    stored_chunks = catalog.documents.chunks_of(unchanged_ids)
    unlinked_docs = {c.doc_id for c in stored_chunks if c.chunk_id not in linked}
    if settings.span_tokens:  # a span's keys chain through its chunks: take whole documents
        candidates = new_chunks + [c for c in stored_chunks if c.doc_id in unlinked_docs]
        report.kv_reused, report.tokens_skipped = catalog.entries.linked_totals(
            profile.profile_id, [d for d in unchanged_ids if d not in unlinked_docs]
        )
        return pending_spans(candidates, lm.tokenizer, profile, layout.separator_ids, settings.span_tokens)
    candidates = new_chunks + [c for c in stored_chunks if c.chunk_id not in linked]
    report.kv_reused, report.tokens_skipped = catalog.entries.linked_totals(profile.profile_id, unchanged_ids)
    return [pending_alone(c, lm.tokenizer, profile) for c in candidates]


def _replace_documents(
    writer: StoreWriter,
    plan: DocumentPlan,
    chunking: Callable[[Document], str],
    lm: LoadedModel,
    settings: IngestSettings,
    reporter: Reporter,
) -> list[ChunkRow]:
    """Retire the chunks (and vectors) of changed and removed documents; chunk new and changed
    ones. Returns the new chunks, still to be embedded."""
    catalog, vectors = writer.catalog, writer.vectors
    new_chunks = _chunk_documents(
        plan.to_chunk, lm.tokenizer, settings.chunk_tokens, catalog.documents.next_chunk_id(), reporter
    )
    per_doc = Counter(c.doc_id for c in new_chunks)
    rows = [DocumentRow(d.doc_id, d.source, content_hash(d), chunking(d), per_doc[d.doc_id]) for d in plan.to_chunk]
    with catalog.transaction():
        retired = catalog.documents.delete_documents(plan.retired_ids)
        if vectors is not None:
            vectors.remove(retired)
        catalog.documents.add_documents(rows, [d.metadata for d in plan.to_chunk], new_chunks)
        _refresh_metadata(catalog, plan.unchanged)
    return new_chunks


def _refresh_metadata(catalog, unchanged: list[Document]) -> None:
    """Record the metadata of documents whose text is unchanged but whose metadata is not (a
    file touched, or read before ragkv recorded path, title and modified time): rows only, no
    chunk is cut or computed again."""
    stored = catalog.documents.metadata_of([d.doc_id for d in unchanged])
    catalog.documents.set_metadata({d.doc_id: d.metadata for d in unchanged if stored.get(d.doc_id) != d.metadata})


def _chunk_documents(
    documents: list[Document], tokenizer, chunk_tokens: int, first_id: int, reporter: Reporter
) -> list[ChunkRow]:
    rows: list[ChunkRow] = []
    reporter.stage("chunking", len(documents), "docs")
    for doc in documents:
        # A document with headings or pages keeps its sections whole and records each chunk's place.
        chunks = chunk_blocks(doc.blocks, tokenizer, chunk_tokens) if doc.blocks else None
        if chunks is None:
            chunks = [Chunk(text) for text in chunk_text(doc.text, tokenizer, chunk_tokens)]
        for index, chunk in enumerate(chunks):
            rows.append(ChunkRow(first_id + len(rows), doc.doc_id, index, chunk.text, chunk.section, chunk.pages))
        reporter.advance(1)
    return rows


def _embed(chunks: list[ChunkRow], embedder: Embedder, vectors, reporter: Reporter, batch: int = 64) -> None:
    reporter.stage("embedding", len(chunks))
    for start in range(0, len(chunks), batch):
        part = chunks[start : start + batch]
        vectors.add([c.chunk_id for c in part], embedder.embed([c.text for c in part]))
        reporter.advance(len(part))


def _compute_and_store(
    writer: StoreWriter,
    work: list[Unit],
    prefix_key: str | None,
    lm: LoadedModel,
    profile: Profile,
    settings: IngestSettings,
    reporter: Reporter,
    report: IngestReport,
) -> None:
    layout = kv.layout_of(lm.model.config)
    metadata = shard_metadata(profile.profile_id, lm.facts.name, profile.dtype, layout.name)
    out = StoredKV(
        writer, profile.profile_id, profile.kv_quant, prefix_key, settings.shard_bytes, metadata, windows=layout.windows
    )
    reporter.stage("KV", sum(len(u.chunks) for u in work))
    compute_started = time.perf_counter()
    prefix_kv = compute_prefix(lm.model, profile.prefix_ids)
    if prefix_key:
        out.put(prefix_key, prefix_kv)
        out.flush()
    batch_tokens = settings.batch_tokens_for(lm.device)
    span_list = [[c.ids for c in u.chunks] for u in work]
    for index, parts in compute_spans(lm.model, prefix_kv, span_list, batch_tokens, lm.pad_id):
        unit = work[index]
        for chunk, new, part in zip(unit.chunks, unit.store, parts, strict=True):
            if new:
                out.put(chunk.key, part)
                report.kv_computed += 1
        report.tokens_computed += len(unit.ids)
        reporter.advance(len(unit.chunks), tokens=len(unit.ids))
    out.flush()
    report.compute_s = time.perf_counter() - compute_started


def _profile_row(profile: Profile, lm: LoadedModel, system_prompt: str, check: SelfCheck) -> ProfileRow:
    return ProfileRow(
        profile.profile_id,
        lm.facts.name,
        profile.model_fingerprint,
        profile.tokenizer_fingerprint,
        profile.template_fingerprint,
        system_prompt,
        tuple(profile.prefix_ids),
        profile.dtype,
        profile.kv_quant,
        lm.facts.num_layers,
        lm.facts.num_kv_heads,
        lm.facts.head_dim,
        kv.layout_of(lm.model.config).to_string(),
        check.to_string(),
    )
