"""What the catalog returns: small frozen rows, one per kind of record."""

from __future__ import annotations

from dataclasses import dataclass

ENTRY_COLUMNS = "e.kv_key, e.shard, e.tensor, e.num_tokens, e.dtype, e.checksum, e.nbytes"


@dataclass(frozen=True)
class ProfileRow:
    """A stored profile: the model, tokenizer, template and dtype its KV was computed with."""

    profile_id: str
    model_name: str
    model_fingerprint: str
    tokenizer_fingerprint: str
    template_fingerprint: str
    system_prompt: str
    prefix_ids: tuple[int, ...]
    dtype: str
    kv_quant: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_layout: str | None = None  # ragkv.kv.layout.KVLayout.to_string(); None: written before, plain
    self_check: str | None = None  # the self-test the profile's first ingest ran (JSON); None: none ran

    COLUMNS = (
        "profile_id",
        "model_name",
        "model_fingerprint",
        "tokenizer_fingerprint",
        "template_fingerprint",
        "system_prompt",
        "prefix_ids",
        "dtype",
        "kv_quant",
        "num_layers",
        "num_kv_heads",
        "head_dim",
        "kv_layout",
        "self_check",
    )


@dataclass(frozen=True)
class ProfileTotals:
    """What a profile holds: for `ragkv stats`."""

    profile_id: str
    model_name: str
    dtype: str
    kv_quant: str
    entries: int
    kv_bytes: int
    chunks: int
    tokens: int
    kv_layout: str | None = None  # ragkv.kv.layout.KVLayout.to_string(); None: plain, or written before


@dataclass(frozen=True)
class SpanChunk:
    """A chunk linked into a span, with its entry's bytes (None: the budget left its KV out)."""

    chunk_id: int
    doc_id: str
    span_start: int
    chunk_index: int
    kv_key: str
    nbytes: int | None


@dataclass(frozen=True)
class SpanLink:
    """One chunk of a stored span: its entry's key and its own token ids."""

    kv_key: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class ChunkLink:
    """Which KV entry holds a chunk under a profile (`span_start`: the chunk_index of the span
    its KV continues; None when its KV was computed on its own)."""

    chunk_id: int
    kv_key: str
    token_ids: tuple[int, ...]
    span_start: int | None = None


@dataclass(frozen=True)
class DocumentRow:
    doc_id: str
    source: str
    content_hash: str
    chunking: str  # chunker identity and settings the chunks were cut with
    num_chunks: int


@dataclass(frozen=True)
class ChunkRow:
    chunk_id: int
    doc_id: str
    chunk_index: int
    text: str
    section: tuple[str, ...] = ()  # the deepest section holding the chunk (headings, outermost first)
    pages: tuple[int, int] | None = None  # the first and last page (or slide) it covers


@dataclass(frozen=True)
class EntryRow:
    """A KV entry's location and checksum."""

    kv_key: str
    shard: str
    tensor: str
    num_tokens: int
    dtype: str
    checksum: str
    nbytes: int


@dataclass(frozen=True)
class ContextRow:
    """A retrieved chunk with its source and, under one profile, its token ids and KV entry."""

    chunk_id: int
    doc_id: str
    source: str
    chunk_index: int
    text: str
    token_ids: tuple[int, ...] | None  # None: no KV computed for this profile
    entry: EntryRow | None
    span_start: int | None = None  # chunk_index its span starts at; None: its KV stands alone
    live: bool = False  # a passage given as text, not from the store: always prefilled, never stored
    section: tuple[str, ...] = ()  # where it is in its document: the deepest section holding it
    pages: tuple[int, int] | None = None  # ... and the pages (or slides) it covers

    @property
    def starts_span(self) -> bool:
        """Whether this chunk's KV was computed right after the prefix (loadable on its own)."""
        return self.span_start is None or self.span_start == self.chunk_index


def pages_of(start: int | None, end: int | None) -> tuple[int, int] | None:
    """A chunk's page range from its two columns (None: the format has no pages)."""
    return (start, end if end is not None else start) if start is not None else None
