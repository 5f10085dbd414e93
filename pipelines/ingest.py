"""`ingest`: read → chunk → plan → embed → compute KV → write shards → publish a generation.

Embedding and KV run in this process (`engine="ragkv"`) or as a Ray Data job
(`engine="ray"`, see ragkv.pipelines.engines.ray_engine); reading, chunking and planning always run here,
against the catalog, so both engines build the same store.

Idempotent: a document whose content and chunking are unchanged is not chunked or embedded
again, and a chunk whose KV key is already in the store is not computed again.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ragkv.core.config import IngestSettings, ModelSettings
from ragkv.core.cpu import run_aside
from ragkv.core.errors import InputError
from ragkv.core.keys import Profile
from ragkv.kv import cache as kv
from ragkv.kv import codec
from ragkv.kv.codec import shard_metadata
from ragkv.model import self_check
from ragkv.model.device import resolved
from ragkv.model.embed import Embedder
from ragkv.model.forward import compute_prefix, compute_spans
from ragkv.model.llm import LoadedModel, load_model
from ragkv.model.prompt import PromptLayout
from ragkv.model.self_check import SelfCheck
from ragkv.pipelines.checks import check_chunks_fit, check_fits, engine_named, for_engine
from ragkv.pipelines.embedding import embed, open_vectors, settle_embedder
from ragkv.pipelines.engines import ray_engine, vllm_engine
from ragkv.pipelines.engines.ray_ingest import RayJob, run_ray_job
from ragkv.pipelines.plan import DocumentPlan, plan_documents
from ragkv.pipelines.progress import Reporter
from ragkv.pipelines.reading.chunk import chunking_id
from ragkv.pipelines.reading.read import Document, Skipped, read_documents
from ragkv.pipelines.replace import replace_documents
from ragkv.pipelines.stored_kv import StoredKV
from ragkv.pipelines.to_compute import PendingChunk, Unit, pending_alone, pending_spans, plan_work, within_budget
from ragkv.store import ChunkRow, StoreWriter
from ragkv.store.catalog import ChunkLink, ProfileRow
from ragkv.store.kv import budget
from ragkv.store.kv.writeback import fold_pending
from ragkv.store.writer import open_writer


@dataclass
class IngestReport:
    store: str
    generation: int = 0
    model: str = ""
    dtype: str = ""
    device: str = ""
    engine: str = "ragkv"
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
    engine: str = "ragkv",
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
    model = resolved(model or ModelSettings())  # "auto" device and dtype, on this machine
    settings = settings or IngestSettings()
    reporter = reporter or Reporter()
    found = read_documents(paths, settings.max_document_bytes)
    if not found.documents:
        reasons = "; ".join(f"{s.source}: {s.reason}" for s in found.skipped[:3]) or "no files"
        raise InputError(f"no documents to ingest under {', '.join(map(str, paths))} ({reasons})")
    engine = engine_named(engine)
    settings = for_engine(engine, store, settings)
    job = RayJob(*ray_engine.connect(workers), model=model) if engine == "ray" else None
    here = "cpu" if job else model.device  # with Ray, this process only plans: the workers compute
    lm, embedder, layout, profile = _models(model, settings, here)
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
        del lm, embedder  # the calibration loads the model it answers with
        report.calibration = _calibrate(store, reporter, model.device)
    report.total_s = time.perf_counter() - started
    return report


def _calibrate(store: Path | str, reporter: Reporter, device: str) -> str:
    """`--calibrate`: what --mode approximate runs as on the profile just built, measured."""
    from ragkv.pipelines.calibrate import CalibrateSettings, calibrate

    return calibrate(store, CalibrateSettings(), reporter, device=device).describe()


def _models(model: ModelSettings, settings: IngestSettings, device: str):
    """The LLM and the embedder loaded on `device`, the prompt layout (the chunk and span sizes
    checked against the model's context), and the profile the KV is stored under."""
    lm = load_model(model.model, device, model.dtype)
    embedder = Embedder.load(
        model.embedder, device, query_prompt=model.query_prompt, document_prompt=model.document_prompt
    )
    layout = PromptLayout.build(lm.tokenizer, settings.system_prompt)
    check_fits(lm, layout, settings.chunk_tokens, "--chunk-tokens")
    check_fits(lm, layout, settings.span_tokens, "--span-tokens")
    quant = codec.kv_quant(settings.kv_dtype, model.dtype)
    facts = lm.facts
    profile = Profile.of_layout(
        facts.fingerprint, facts.tokenizer_fingerprint, layout, model.dtype, quant, facts.kv_layout_key
    )
    return lm, embedder, layout, profile


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
    space_changed = settle_embedder(writer, embedder)
    spans_part = f";span={settings.span_tokens}" if settings.span_tokens else ""

    def chunking(doc: Document) -> str:
        return chunking_id(settings.chunk_tokens, bool(doc.blocks)) + spans_part

    plan = plan_documents(documents, catalog.documents.all(), chunking, prune)
    report.skipped += plan.conflicts
    report.documents = plan.counts()
    new_chunks = replace_documents(writer, plan, chunking, lm, settings, reporter)
    vectors, num_again = open_vectors(writer, embedder, {c.chunk_id for c in new_chunks}, space_changed, reporter)
    report.chunks_embedded = len(new_chunks) + num_again

    pending = _unlinked(catalog, plan, new_chunks, lm, layout, profile, settings, report)
    check_chunks_fit(pending, lm, layout)
    if catalog.entries.profile(profile.profile_id) is None:  # a new profile: its self-test first (raises)
        check = run_aside(self_check.check_loaded, lm)
        catalog.entries.add_profile(_profile_row(profile, lm, settings.system_prompt, check))
    limit = settings.kv_budget if settings.kv_budget is not None else catalog.usage.kv_budget()
    # a span's chunks are all linked, KV or not: the link keeps each one's key and place
    links = pending if settings.span_tokens else None
    pending = _admitted(writer, pending, lm, profile, limit, settings, report)
    links = pending if links is None else links
    todo = plan_work(catalog, pending, profile)
    report.kv_reused += todo.num_reused
    report.tokens_skipped += todo.tokens_reused
    models = _Models(lm, embedder, profile, job, to_vllm)
    deferred = _embed_and_compute(
        writer, todo.units, todo.prefix_key, new_chunks, vectors, models, settings, reporter, report
    )
    if deferred and not settings.span_tokens:  # linked once vLLM has stored their KV
        links = [p for p in links if p.key not in deferred]
    catalog.entries.link_chunks(
        profile.profile_id, [ChunkLink(p.chunk_id, p.key, p.token_ids, p.span_start) for p in links]
    )
    if limit is not None:  # estimates planned the work; the bytes written decide
        report.kv_evicted += len(budget.enforce(writer, profile.profile_id, limit))
        catalog.set_meta({"kv_budget": str(limit)})
    catalog.set_meta({**embedder.meta(), "last_profile": profile.profile_id})


@dataclass(frozen=True)
class _Models:
    """What computes an ingest's embeddings and KV: this process's models, or the Ray `job`, or,
    given `to_vllm`, vLLM after the publish (its units appended there)."""

    lm: LoadedModel
    embedder: Embedder
    profile: Profile
    job: RayJob | None
    to_vllm: list[Unit] | None


def _embed_and_compute(writer, work, prefix_key, new_chunks, vectors, models: _Models, settings, reporter, report):
    """Embed the new chunks and compute and store the planned KV `work` (and the prefix's).
    Returns the keys left for vLLM to compute after the publish (none otherwise)."""
    lm, profile = models.lm, models.profile
    if models.job:
        chunks = [u.chunks[0] for u in work]  # without spans every unit is one chunk
        done = run_ray_job(
            models.job,
            writer,
            new_chunks,
            chunks,
            prefix_key,
            lm,
            profile,
            settings,
            vectors,
            reporter,
            models.embedder.prompts,
        )
        report.kv_computed += done.kv_computed
        report.tokens_computed += done.tokens_computed
        report.compute_s = done.compute_s
        return set()
    embed(new_chunks, models.embedder, vectors, reporter)
    if models.to_vllm is None:
        _compute_and_store(writer, work, prefix_key, lm, profile, settings, reporter, report)
        return set()
    _compute_and_store(writer, [], prefix_key, lm, profile, settings, reporter, report)  # the prefix here
    models.to_vllm.extend(work)  # the chunks in vLLM, after the publish
    later = {c.key for u in work for c, new in zip(u.chunks, u.store, strict=True) if new}
    report.kv_deferred += len(later)
    return later


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
        writer, profile.profile_id, profile.kv_quant, prefix_key, settings.shard_bytes, metadata, layout=layout
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
