"""Integrity checks over a published generation: every KV entry readable and matching its
checksum, every chunk link pointing at an entry, every profile's prefix present, the vector
index readable and holding exactly the catalog's chunks, each segment's lexical file readable and
holding its segment's chunks. (`CURRENT` and the catalog are checked
by opening the generation at all.) Hit-log lines that record no use are reported as warnings:
popularity skips them, and they harm nothing stored."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import numpy as np

from ragkv.core.errors import StoreCorruptError
from ragkv.core.keys import KVKey
from ragkv.store.kv.popularity import HITS_DIR, read_pending
from ragkv.store.snapshot import StoreSnapshot


@dataclass(frozen=True)
class Problem:
    kind: str  # "entry" (unreadable / checksum), "link" (chunk points at no entry), "prefix", "vectors"
    # (missing or stray vectors), "vectors-unreadable" (the index file itself), "lexical" (a
    # segment's lexical file unreadable or not matching its segment)
    detail: str
    kv_key: str = ""
    file: str = ""  # "lexical": the file's name in the segment folder


@dataclass
class VerifyReport:
    generation: int
    entries_checked: int = 0
    bytes_checked: int = 0
    seconds: float = 0.0
    problems: list[Problem] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # not problems: nothing stored is wrong

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}


def verify(snapshot: StoreSnapshot) -> VerifyReport:
    start = time.perf_counter()
    report = VerifyReport(snapshot.generation)
    catalog = snapshot.catalog
    for entry in catalog.reports.all_entries():
        try:
            parts = snapshot.shards.read_parts(entry.shard, entry.tensor, entry.checksum)
            report.bytes_checked += sum(t.numel() * t.element_size() for t in parts.values())
        except StoreCorruptError as exc:
            report.problems.append(Problem("entry", str(exc), entry.kv_key))
        report.entries_checked += 1
    for chunk_id, _, kv_key in catalog.entries.links_without_entries():
        report.problems.append(
            Problem("link", f"chunk {chunk_id} points at a KV entry that is not in the catalog", kv_key)
        )
    for profile_id in catalog.entries.linked_profiles():
        key = KVKey.prefix_of(profile_id).to_string()
        if catalog.entries.entry(key) is None:
            report.problems.append(Problem("prefix", f"profile {profile_id[:16]} has no system-prompt KV", key))
    if snapshot.vectors_damage:
        report.problems.append(Problem("vectors-unreadable", snapshot.vectors_damage))
    else:
        indexed = set(snapshot.vectors.ids().tolist())
        chunks = catalog.documents.chunk_ids()
        if indexed != chunks:
            report.problems.append(
                Problem(
                    "vectors",
                    f"{len(chunks - indexed)} chunks missing from the vector index, "
                    f"{len(indexed - chunks)} stray vectors",
                )
            )
        _verify_lexical(snapshot, report)
    unusable = read_pending(snapshot.root, catalog.usage.folded_offsets()).unusable  # a bucket's mirror: none
    report.warnings += [
        f"{HITS_DIR}/{name}: {count} lines record no use (popularity skips them)"
        for name, count in sorted(unusable.items())
    ]
    report.seconds = time.perf_counter() - start
    return report


def _verify_lexical(snapshot: StoreSnapshot, report: VerifyReport) -> None:
    """Each segment's lexical file readable and holding exactly its segment's chunks."""
    vectors = snapshot.vectors
    for info in vectors.segments:
        if not info.has_terms:
            continue
        segment = vectors.segment(info)
        try:
            postings = segment.postings()
        except StoreCorruptError as exc:
            report.problems.append(Problem("lexical", str(exc), file=info.terms))
            continue
        assert postings is not None  # the segment names a lexical file
        if not np.array_equal(np.sort(postings.chunk_ids), np.sort(segment.ids())):
            detail = f"the lexical index file {info.terms} does not hold the chunks of its segment {info.name}"
            report.problems.append(Problem("lexical", detail, file=info.terms))
    if missing := vectors.num_without_terms():
        report.warnings.append(
            f"the lexical index does not cover {missing} chunks (a store written before it); "
            "the next write builds it (e.g. ragkv gc)"
        )
