"""The catalog side of an ingest: documents that changed or went away retired with their chunks and
vectors, new and changed ones chunked (sections kept whole where a document has them), and the
metadata of unchanged documents refreshed, all in one transaction."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from ragkv.core.config import IngestSettings
from ragkv.model.llm import LoadedModel
from ragkv.pipelines.plan import DocumentPlan, content_hash
from ragkv.pipelines.progress import Reporter
from ragkv.pipelines.reading.chunk import Chunk, chunk_blocks, chunk_text
from ragkv.pipelines.reading.read import Document
from ragkv.store import ChunkRow, DocumentRow, StoreWriter


def replace_documents(
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
    new_chunks = chunk_documents(
        plan.to_chunk, lm.tokenizer, settings.chunk_tokens, catalog.documents.next_chunk_id(), reporter
    )
    per_doc = Counter(c.doc_id for c in new_chunks)
    rows = [DocumentRow(d.doc_id, d.source, content_hash(d), chunking(d), per_doc[d.doc_id]) for d in plan.to_chunk]
    with catalog.transaction():
        retired = catalog.documents.delete_documents(plan.retired_ids)
        if vectors is not None:
            vectors.remove(retired)
        catalog.documents.add_documents(rows, [d.metadata for d in plan.to_chunk], new_chunks)
        refresh_metadata(catalog, plan.unchanged)
    return new_chunks


def refresh_metadata(catalog, unchanged: list[Document]) -> None:
    """Record the metadata of documents whose text is unchanged but whose metadata is not (a
    file touched, or read before ragkv recorded path, title and modified time): rows only, no
    chunk is cut or computed again."""
    stored = catalog.documents.metadata_of([d.doc_id for d in unchanged])
    catalog.documents.set_metadata({d.doc_id: d.metadata for d in unchanged if stored.get(d.doc_id) != d.metadata})


def chunk_documents(
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
