"""Plan an ingest: which documents are new, changed, unchanged or gone, by identity and content."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from ragkv.core.keys import digest
from ragkv.pipelines.reading.read import Document, Skipped
from ragkv.store import DocumentRow

# Where a document is, what it is called and when it changed (a file's own dates and counts
# too): not its content, which is what its chunks depend on.
LOCATION_FIELDS = ("path", "title", "modified", "author", "created", "modified_in_file", "pages", "slides")


def content_hash(doc: Document) -> str:
    """The document's text and its own metadata (a jsonl record's fields): what its chunks
    depend on. Where it was read from and when (LOCATION_FIELDS) are kept out, so a touched
    file is not re-chunked: its metadata is updated in place."""
    own = {k: v for k, v in doc.metadata.items() if k not in LOCATION_FIELDS}
    return digest(doc.text, json.dumps(own, sort_keys=True, default=str))


@dataclass
class DocumentPlan:
    added: list[Document] = field(default_factory=list)
    changed: list[Document] = field(default_factory=list)  # content or chunking differs
    unchanged: list[Document] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)  # doc ids (only when pruning)
    conflicts: list[Skipped] = field(default_factory=list)  # ids another file still holds (not replaced)

    @property
    def to_chunk(self) -> list[Document]:
        return self.added + self.changed

    @property
    def retired_ids(self) -> list[str]:
        """Documents whose stored chunks go: changed (replaced) and removed ones."""
        return [d.doc_id for d in self.changed] + self.removed

    def counts(self) -> dict[str, int]:
        return {
            "added": len(self.added),
            "changed": len(self.changed),
            "unchanged": len(self.unchanged),
            "removed": len(self.removed),
        }


def plan_documents(
    documents: list[Document], stored: dict[str, DocumentRow], chunking: Callable[[Document], str], prune: bool
) -> DocumentPlan:
    """Compare documents read now with those stored. With `prune`, stored documents not read
    now are removed (the paths given are the whole corpus). Without it, a changed document
    whose id is stored from another file that still exists (two trees both holding
    `faq.jsonl` with the same record ids, or both a `README.md`) is a conflict: listed, never
    silently replaced. The same text from another file (a copy of the tree) is unchanged."""
    plan = DocumentPlan()
    for doc in documents:
        old = stored.get(doc.doc_id)
        if old is None:
            plan.added.append(doc)
        elif old.content_hash != content_hash(doc) or old.chunking != chunking(doc):
            if not prune and is_other_file(old.source, doc.source):
                plan.conflicts.append(
                    Skipped(
                        doc.source,
                        f"document id {doc.doc_id!r} is stored from {old.source}, "
                        "which still exists and differs: give this one another id, or reindex "
                        "to make the store hold exactly these paths",
                    )
                )
            else:
                plan.changed.append(doc)
        else:
            plan.unchanged.append(doc)
    if prune:
        present = {d.doc_id for d in documents}
        plan.removed = sorted(doc_id for doc_id in stored if doc_id not in present)
    return plan


_LINE = re.compile(r":\d+$")  # a jsonl record's source: FILE:LINE


def is_other_file(stored_source: str, source: str) -> bool:
    """Whether `stored_source` names an existing file other than the one `source` was read from
    (a moved or deleted file, or a line that moved within its file, is the same document)."""
    old, new = _LINE.sub("", stored_source), _LINE.sub("", source)
    return os.path.isfile(old) and os.path.realpath(old) != os.path.realpath(new)
