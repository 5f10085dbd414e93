"""`verify --repair`: recompute KV entries that are missing or fail their checksum, re-embed
chunks missing from the vector index, with the model each entry's profile names, and rebuild
damaged lexical files from the chunks' texts."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from ragkv.core.config import IngestSettings
from ragkv.core.errors import ModelError
from ragkv.core.keys import KVKey
from ragkv.kv import cache as kv
from ragkv.kv import spans
from ragkv.kv.codec import shard_metadata
from ragkv.model.embed import Embedder, EmbedPrompts
from ragkv.model.forward import compute_prefix, compute_spans
from ragkv.model.llm import load_model
from ragkv.model.prompt import PromptLayout
from ragkv.pipelines.stored_kv import StoredKV
from ragkv.store import StoreWriter, open_snapshot, verify
from ragkv.store.generations import restore_current
from ragkv.store.objects import is_remote
from ragkv.store.writer import open_writer


@dataclass
class RepairReport:
    problems_found: int = 0
    entries_recomputed: int = 0
    entries_dropped: int = 0  # bad entries no chunk uses (nothing to recompute them from)
    chunks_reembedded: int = 0
    lexical_rebuilt: int = 0  # lexical files rebuilt from the chunks' texts
    unrepairable: list[str] = field(default_factory=list)  # why, per profile that could not be loaded
    current_restored: int | None = None  # the generation a damaged CURRENT was pointed back at
    generation: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


def repair(store: Path | str, device: str = "cpu", wait: bool = False) -> RepairReport:
    restored = None if is_remote(store) or not Path(store).is_dir() else restore_current(Path(store), wait)
    with open_snapshot(store, require_documents=False, lenient=True) as snapshot:
        problems = verify(snapshot).problems
    report = RepairReport(problems_found=len(problems) + (restored is not None), current_restored=restored)
    if not problems:
        return report
    bad_keys = {p.kv_key for p in problems if p.kind in ("entry", "link", "prefix")}
    unreadable_index = any(p.kind == "vectors-unreadable" for p in problems)
    with open_writer(store, wait=wait, rebuild_vectors=unreadable_index) as writer:
        by_profile: dict[str, list[str]] = {}
        for key in bad_keys:
            by_profile.setdefault(KVKey.from_string(key).profile_id, []).append(key)
        for profile_id, keys in by_profile.items():
            _recompute(writer, profile_id, keys, device, report)
        if any(p.kind.startswith("vectors") for p in problems):
            _reindex_vectors(writer, device, report)
        damaged = {p.file for p in problems if p.kind == "lexical"}
        if damaged and writer.vectors is not None:
            writer.vectors.drop_terms(damaged)  # publishing rebuilds them from the chunks' texts
            report.lexical_rebuilt = len(damaged)
        report.generation = writer.generation
    return report


def _recompute(writer: StoreWriter, profile_id: str, keys: list[str], device: str, report: RepairReport) -> None:
    catalog = writer.catalog
    row = catalog.entries.profile(profile_id)
    if row is None:
        report.unrepairable.append(f"profile {profile_id[:16]} is not in the catalog")
        return
    try:
        lm = load_model(row.model_name, device, row.dtype)
    except ModelError as exc:
        report.unrepairable.append(f"{row.model_name}: {exc}")
        return
    if lm.facts.fingerprint != row.model_fingerprint:
        report.unrepairable.append(f"{row.model_name}: weights differ from those the KV was computed with")
        return
    prefix_key = KVKey.prefix_of(profile_id).to_string()
    layout = kv.layout_of(lm.model.config)
    metadata = shard_metadata(profile_id, row.model_name, row.dtype, layout.name)
    shard_bytes = IngestSettings().shard_bytes
    out = StoredKV(writer, profile_id, row.kv_quant, prefix_key, shard_bytes, metadata, True, layout)
    prefix_kv = compute_prefix(lm.model, row.prefix_ids)
    if prefix_key in keys:
        out.put(prefix_key, prefix_kv)
    chunk_keys = [k for k in keys if k != prefix_key and catalog.entries.token_ids_of(k) is not None]
    unused = [k for k in keys if k != prefix_key and k not in chunk_keys]
    catalog.entries.delete_entries(unused)
    report.entries_dropped += len(unused)
    separator = PromptLayout.build(lm.tokenizer, row.system_prompt).separator_ids
    to_compute = _spans_of(catalog, chunk_keys, separator)
    batch_tokens = IngestSettings().batch_tokens_for(device)
    for index, parts in compute_spans(lm.model, prefix_kv, [s for _, s in to_compute], batch_tokens, lm.pad_id):
        for key, part in zip(to_compute[index][0], parts, strict=True):
            if key in chunk_keys:
                out.put(key, part)
    out.flush()
    report.entries_recomputed += out.written


def _spans_of(catalog, keys: list[str], separator) -> list[tuple[list[str], list[tuple[int, ...]]]]:
    """What to compute to rebuild `keys`: per span (or chunk stored alone) holding any of
    them, its keys and the segments its KV was computed from, in order (a span's later
    chunks continue it, separator first, so the whole span is computed again)."""
    found, covered = [], set()
    for key in keys:
        if key in covered:
            continue
        links = catalog.entries.span_links(key)
        span_keys = [link.kv_key for link in links]
        segments = spans.segments([link.token_ids for link in links], separator)
        covered.update(span_keys)
        found.append((span_keys, segments))
    return found


def _reindex_vectors(writer: StoreWriter, device: str, report: RepairReport) -> None:
    """Make the vector index hold exactly the catalog's chunks: an index the writer starts
    empty (the published one was unreadable) is rebuilt from the chunk texts."""
    catalog = writer.catalog
    embedder: Embedder | None = None
    recorded = EmbedPrompts.from_meta(catalog.meta().get("embedder_prompts"))
    if writer.vectors is None:  # started empty: the new index replaces the old one even if it holds nothing
        embedder = Embedder.load(catalog.meta()["embedder"], device, recorded)
        writer.ensure_vectors(embedder.dim).mark_changed()
    vectors = writer.vectors
    assert vectors is not None  # a writer that repairs has opened (or just made) its index
    indexed = set(vectors.ids().tolist())
    chunks = catalog.documents.chunk_ids()
    vectors.remove(sorted(indexed - chunks))
    missing = sorted(chunks - indexed)
    if missing:
        embedder = embedder or Embedder.load(catalog.meta()["embedder"], device, recorded)
        texts = catalog.documents.chunk_texts(missing)
        vectors.add(missing, embedder.embed_documents([texts[i] for i in missing]))
    report.chunks_reembedded = len(missing)
