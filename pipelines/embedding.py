"""The vectors of an ingest: the embedder settled against the store's embedding space (its
model and its recorded prompts, ragkv.model.embed), new chunks embedded as documents, and every
chunk embedded again into a fresh index when the prompts changed (spaces are never mixed)."""

from __future__ import annotations

from ragkv.core.errors import ModelError
from ragkv.model.embed import Embedder, EmbedPrompts
from ragkv.pipelines.progress import Reporter
from ragkv.store import ChunkRow, StoreWriter, VectorIndex


def settle_embedder(writer: StoreWriter, embedder: Embedder) -> bool:
    """Embed as the store does: with the prompts it recorded (none, for a store written before
    prompts were recorded), unless the embedder's were asked for (--query-prompt or
    --document-prompt: `embedder.prompts_asked`). Returns
    whether the store's chunks must be embedded again: the prompts changed, so its vectors are in
    another space. ModelError for another embedder model."""
    meta = writer.catalog.meta()
    if "embedder_fingerprint" not in meta:  # a new store: the embedder's own prompts
        return False
    if not embedder.prompts_asked:
        embedder.prompts = EmbedPrompts.from_meta(meta.get("embedder_prompts"))
    if meta.get("embedder_weights", meta["embedder_fingerprint"]) != embedder.weights_fingerprint:
        raise ModelError(
            f"store {writer.root} was built with embedder {meta.get('embedder')}; "
            f"ingest with --embedder {meta.get('embedder')} or use a new store"
        )
    return embedder.fingerprint != meta["embedder_fingerprint"]


def embed(chunks: list[ChunkRow], embedder: Embedder, vectors, reporter: Reporter, batch: int = 64) -> None:
    reporter.stage("embedding", len(chunks))
    for start in range(0, len(chunks), batch):
        part = chunks[start : start + batch]
        vectors.add([c.chunk_id for c in part], embedder.embed_documents([c.text for c in part]))
        reporter.advance(len(part))


def open_vectors(
    writer: StoreWriter, embedder: Embedder, new: set[int], space_changed: bool, reporter: Reporter
) -> tuple[VectorIndex, int]:
    """The index an ingest adds its `new` chunks' vectors to, and how many kept chunks were
    embedded into it again: a fresh index, when the space changed (see `settle_embedder`)."""
    if not space_changed:
        return writer.ensure_vectors(embedder.dim), 0
    vectors = writer.fresh_vectors(embedder.dim)
    return vectors, reembed(writer.catalog, embedder, vectors, new, reporter)


def reembed(catalog, embedder: Embedder, vectors, new: set[int], reporter: Reporter, batch: int = 256) -> int:
    """Embed every stored chunk but the `new` ones (embedded after) into `vectors`, a fresh index:
    the store's embedding prompts changed. Returns how many."""
    kept = sorted(catalog.documents.chunk_ids() - new)
    reporter.stage("re-embedding (new prompts)", len(kept))
    for start in range(0, len(kept), batch):
        part = kept[start : start + batch]
        texts = catalog.documents.chunk_texts(part)
        vectors.add(part, embedder.embed_documents([texts[i] for i in part]))
        reporter.advance(len(part))
    return len(kept)
