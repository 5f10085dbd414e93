"""Documents and their chunks (a part of `Catalog`: `catalog.documents`)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

import pyarrow as pa

from ragkv.core.filters import AnyOf, Condition, Filter
from ragkv.store.catalog.part import Part
from ragkv.store.catalog.rows import ChunkRow, DocumentRow, pages_of

# A filter field's value in SQL (`d`: documents); other fields are keys of the metadata JSON.
# `path` falls back to the document id, which is a file's path under the folder ingested
# (documents read before ragkv recorded a path).
_FIELDS = {
    "id": "d.doc_id",
    "source": "d.source",
    "path": "coalesce(json_extract_string(d.metadata, '$.path'), d.doc_id)",
}


class Documents(Part):
    def all(self) -> dict[str, DocumentRow]:
        rows = self.con.execute("SELECT doc_id, source, content_hash, chunking, num_chunks FROM documents").fetchall()
        return {row[0]: DocumentRow(*row) for row in rows}

    def chunks_of(self, doc_ids: Iterable[str]) -> list[ChunkRow]:
        ids = list(doc_ids)
        if not ids:
            return []
        rows = self.con.execute(
            "SELECT chunk_id, doc_id, chunk_index, text, section, page_start, page_end FROM chunks "
            "WHERE doc_id IN (SELECT unnest(?)) ORDER BY doc_id, chunk_index",
            [ids],
        ).fetchall()
        return [ChunkRow(row[0], row[1], row[2], row[3], tuple(row[4] or ()), pages_of(row[5], row[6])) for row in rows]

    def next_chunk_id(self) -> int:
        """An id no chunk ever had: vector segments keep a removed chunk's id as a tombstone."""
        high = self.con.execute("SELECT value FROM meta WHERE key = 'next_chunk_id'").fetchone()
        current = self.catalog.value("SELECT coalesce(max(chunk_id), -1) + 1 FROM chunks")
        return max(current, int(high[0]) if high else 0)

    def delete_documents(self, doc_ids: Sequence[str]) -> list[int]:
        """Remove documents with their chunks and chunk-to-KV links; returns the chunk ids removed.
        KV entries stay (other chunks or profiles may share them); garbage collection drops them."""
        if not doc_ids:
            return []
        ids = list(doc_ids)
        chunk_ids = [
            r[0]
            for r in self.con.execute(
                "SELECT chunk_id FROM chunks WHERE doc_id IN (SELECT unnest(?))", [ids]
            ).fetchall()
        ]
        self.catalog.delete_rows("chunk_kv", "chunk_id IN (SELECT unnest(?))", [chunk_ids])
        self.catalog.delete_rows("chunks", "doc_id IN (SELECT unnest(?))", [ids])
        self.catalog.delete_rows("documents", "doc_id IN (SELECT unnest(?))", [ids])
        return chunk_ids

    def add_documents(
        self, documents: Sequence[DocumentRow], metadata: Sequence[dict], chunks: Sequence[ChunkRow]
    ) -> None:
        new_docs = pa.table(
            {
                "doc_id": [d.doc_id for d in documents],
                "source": [d.source for d in documents],
                "content_hash": [d.content_hash for d in documents],
                "chunking": [d.chunking for d in documents],
                "num_chunks": pa.array([d.num_chunks for d in documents], pa.int32()),
                "metadata": [json.dumps(m, sort_keys=True) for m in metadata],
            }
        )
        new_chunks = pa.table(
            {
                "chunk_id": pa.array([c.chunk_id for c in chunks], pa.int64()),
                "doc_id": [c.doc_id for c in chunks],
                "chunk_index": pa.array([c.chunk_index for c in chunks], pa.int32()),
                "text": [c.text for c in chunks],
                "section": pa.array([list(c.section) or None for c in chunks], pa.list_(pa.string())),
                "page_start": pa.array([c.pages[0] if c.pages else None for c in chunks], pa.int32()),
                "page_end": pa.array([c.pages[1] if c.pages else None for c in chunks], pa.int32()),
            }
        )
        self.catalog.insert_rows(
            "documents",
            new_docs,
            "SELECT doc_id, source, content_hash, chunking, num_chunks, metadata, "
            "current_timestamp::TIMESTAMP AS ingested_at FROM rows",
        )
        self.catalog.insert_rows("chunks", new_chunks)
        if chunks:
            self.catalog.set_meta_rows(
                {"next_chunk_id": str(max(self.next_chunk_id(), max(c.chunk_id for c in chunks) + 1))}
            )

    def chunk_texts(self, chunk_ids: Sequence[int]) -> dict[int, str]:
        rows = self.con.execute(
            "SELECT chunk_id, text FROM chunks WHERE chunk_id IN (SELECT unnest(?))", [list(chunk_ids)]
        ).fetchall()
        return dict(rows)

    def chunk_refs(self, chunk_ids: Sequence[int]) -> dict[int, tuple[str, int, str]]:
        """`{chunk_id: (doc_id, chunk_index, text)}` of those of `chunk_ids` the store holds."""
        rows = self.con.execute(
            "SELECT chunk_id, doc_id, chunk_index, text FROM chunks WHERE chunk_id IN (SELECT unnest(?))",
            [list(chunk_ids)],
        ).fetchall()
        return {r[0]: (r[1], r[2], r[3]) for r in rows}

    def chunk_ids_of(self, doc_id: str) -> list[int]:
        return [
            r[0]
            for r in self.con.execute(
                "SELECT chunk_id FROM chunks WHERE doc_id = ? ORDER BY chunk_index", [doc_id]
            ).fetchall()
        ]

    def metadata_of(self, doc_ids: Sequence[str]) -> dict[str, dict]:
        """Each stored document's metadata (what a filter reads)."""
        rows = self.con.execute(
            "SELECT doc_id, metadata FROM documents WHERE doc_id IN (SELECT unnest(?))", [list(doc_ids)]
        ).fetchall()
        return {doc_id: json.loads(metadata or "{}") for doc_id, metadata in rows}

    def set_metadata(self, metadata: dict[str, dict]) -> None:
        """Replace stored documents' metadata (a file touched, its text unchanged)."""
        if not metadata:
            return
        rows = pa.table(
            {"doc_id": list(metadata), "metadata": [json.dumps(m, sort_keys=True) for m in metadata.values()]}
        )
        self.catalog.insert_rows(
            "documents",
            rows,
            "SELECT d.doc_id, d.source, d.content_hash, d.chunking, d.num_chunks, r.metadata, d.ingested_at "
            "FROM documents d JOIN rows r USING (doc_id)",
            replace=True,
        )

    def metadata_fields(self) -> list[str]:
        """The keys any stored document's metadata has."""
        rows = self.con.execute(
            "SELECT DISTINCT unnest(json_keys(metadata)) FROM documents WHERE metadata IS NOT NULL"
        ).fetchall()
        return sorted(r[0] for r in rows)

    def chunk_ids_matching(self, conditions: Sequence[Condition]) -> list[int]:
        """The chunks of the documents matching every condition (ragkv.core.filters; values are
        bound as parameters, fields are column names or metadata keys checked by the parser)."""
        clauses, params = [], []
        for condition in conditions:
            clause, values = _clause(condition)
            clauses.append(clause)
            params += values
        rows = self.con.execute(
            "SELECT c.chunk_id FROM chunks c JOIN documents d USING (doc_id) WHERE "
            + " AND ".join(clauses or ["TRUE"])
            + " ORDER BY c.chunk_id",
            params,
        ).fetchall()
        return [r[0] for r in rows]

    def chunk_ids(self) -> set[int]:
        return {r[0] for r in self.con.execute("SELECT chunk_id FROM chunks").fetchall()}


def _clause(condition: Condition) -> tuple[str, list]:
    """SQL over `d` (documents) true where `condition` holds, and its parameters. A document
    without the field matches no comparison."""
    if isinstance(condition, AnyOf):
        parts = [_comparison(option) for option in condition.options]
        return "(" + " OR ".join(sql for sql, _ in parts) + ")", [p for _, values in parts for p in values]
    return _comparison(condition)


def _comparison(condition: Filter) -> tuple[str, list]:
    if condition.field in _FIELDS:
        field, params = _FIELDS[condition.field], []
    else:
        field, params = "json_extract_string(d.metadata, ?)", [f'$."{condition.field}"']
    op, value, number = condition.op, condition.value, condition.number
    if condition.is_pattern:
        negate = "NOT " if op == "!=" else ""
        return f"({field} IS NOT NULL AND {negate}({field} GLOB ?))", params * 2 + [value]
    if number is not None and op in ("=", "!="):
        negate = "NOT " if op == "!=" else ""
        same = f"(TRY_CAST({field} AS DOUBLE) = ? OR {field} = ?)"
        return f"({field} IS NOT NULL AND {negate}{same})", params * 2 + [number] + params + [value]
    if number is not None:
        return f"(TRY_CAST({field} AS DOUBLE) {op} ?)", params + [number]
    return f"({field} {op} ?)", params + [value]
