"""What a ragkv store holds of a prompt given as token ids: the engine-neutral half of a KV
connector (vLLM's lives in ragkv.integrations.vllm).

A prompt ragkv laid out starts with its profile's prefix ids (chat template head and system
prompt), then a chunk, then, for a chunk that starts a span, the chunks that continue it.
Those are the tokens whose stored KV sits at exactly the positions the prompt puts them, so
only they are matched. The match walks ragkv's key chain: for each chunk length the store
holds, the key of the next tokens is computed and looked up; a key found is accepted only
after its stored token ids are compared with the prompt's.

A front that laid the prompt out (`ragkv serve --engine vllm`) also says which token ranges
are which chunks, in the request's `kv_transfer_params`:

    {"ragkv": {"chunks": [[chunk_id, num_tokens], ...], "write_back": true}}

the chunks in prompt order after the prefix, joined by the layout's separator. With it the
engine logs each chunk's use (popularity and the hit rate, as ragkv's own engine does), and,
with `write_back`, stores each chunk of the prompt's leading run the store lacks: the chunks
whose KV in the prompt is exactly what ingest computes (a chunk after the prefix alone, or a
span's chunks from its start). Given the fleet's pending KV (a replica of an S3 store), that
run is first looked for there, and what is found is loaded instead of computed. Nothing in the
params is trusted for the store's contents: the key is computed from the prompt's own ids,
and those ids must be the chunk's own (as ingest linked them, else its text as the store's
tokenizer encodes it).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ragkv.core.errors import InputError, ModelError
from ragkv.core.keys import KVKey, Profile
from ragkv.kv import spans
from ragkv.kv.layout import KVLayout, layout_of
from ragkv.model.profiles import candidates, first_matching
from ragkv.store import EntryRow, open_snapshot
from ragkv.store.kv.pending import PendingIndex
from ragkv.store.kv.popularity import Use

PARAMS_KEY = "ragkv"  # the entry of a request's kv_transfer_params that ragkv reads
log = logging.getLogger("ragkv")


@dataclass(frozen=True)
class StoreMatch:
    """The leading prompt tokens whose KV the store holds, and the entries holding them in
    order: the prefix's, then each chunk's (or span segment's)."""

    num_tokens: int
    entries: tuple[EntryRow, ...]
    pending: frozenset[str] = frozenset()  # keys of entries another replica left pending (not stored yet)


@dataclass(frozen=True)
class LaidOutChunk:
    """A chunk of a laid-out prompt: prompt positions start..end-1 hold its tokens."""

    chunk_id: int
    start: int
    end: int


@dataclass(frozen=True)
class SaveTarget:
    """A chunk the store lacks, whose KV the engine computes in this prompt: store prompt
    positions start..end-1 (its entry's: within a span, the separator before it too)."""

    kv_key: str
    chunk_id: int
    token_ids: tuple[int, ...]  # the chunk's own ids
    start: int
    end: int
    span_start: int | None = None  # chunk_index of the span it belongs to (None: stored alone)
    parent: str | None = None  # the key of the entry before it in its span (None: it opens it)


@dataclass(frozen=True)
class RequestPlan:
    """What a laid-out request means for the store: the uses to log, and what to save."""

    uses: tuple[Use, ...]
    saves: tuple[SaveTarget, ...] = ()
    match: StoreMatch | None = None  # the store's match, extended by the fleet's pending KV


@dataclass(frozen=True)
class RequestLayout:
    """The chunks a request's params lay out, and whether it asks to store a missing one."""

    chunks: tuple[LaidOutChunk, ...] = ()
    write_back: bool = False


def chunk_layout(
    params: Mapping[str, Any] | None, prompt_len: int, prefix_len: int, separator_len: int
) -> RequestLayout:
    """What a request's `kv_transfer_params` lay out (nothing without ragkv params);
    InputError (one line) when they are malformed."""
    if params is not None and not isinstance(params, Mapping):
        raise InputError("kv_transfer_params must be an object")
    block = (params or {}).get(PARAMS_KEY)
    if block is None or block == "skip":
        return RequestLayout()
    if not isinstance(block, Mapping):
        raise InputError(f'kv_transfer_params["{PARAMS_KEY}"] must be an object or "skip"')
    unknown = set(block) - {"chunks", "write_back"}
    if unknown:
        raise InputError(
            f'kv_transfer_params["{PARAMS_KEY}"] has unknown fields: {", ".join(sorted(map(str, unknown)))}'
        )
    write_back = block.get("write_back", False)
    raw = block.get("chunks", [])
    if not isinstance(write_back, bool) or not isinstance(raw, list):
        raise InputError(f'kv_transfer_params["{PARAMS_KEY}"]: "chunks" must be a list and "write_back" a boolean')
    chunks, pos = [], prefix_len
    for i, item in enumerate(raw):
        if not (
            isinstance(item, (list, tuple))
            and len(item) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in item)
            and item[1] > 0
        ):
            raise InputError(
                f'kv_transfer_params["{PARAMS_KEY}"]["chunks"][{i}] must be [chunk_id, num_tokens] with num_tokens > 0'
            )
        start = pos + (separator_len if i else 0)
        chunks.append(LaidOutChunk(item[0], start, start + item[1]))
        pos = start + item[1]
    if pos > prompt_len:
        raise InputError(
            f'kv_transfer_params["{PARAMS_KEY}"] lays out {pos} tokens, more than the prompt\'s {prompt_len}'
        )
    return RequestLayout(tuple(chunks), write_back)


@dataclass(frozen=True)
class ModelIdentity:
    """What a serving engine runs, as ragkv keys KV: weights, tokenizer, dtype and cache layout."""

    model_fingerprint: str
    tokenizer_fingerprint: str
    dtype: str
    tokenizer: Any  # to rebuild the prompt layout (template and system prompt) of a profile
    layout: KVLayout | None = None  # what its cache holds per layer (None: the plain layout)

    @classmethod
    def of_folder(cls, folder: str | Path, dtype: str) -> ModelIdentity:
        """The identity of the model in `folder`, its layout read off its config (attention
        layers of one shape: what the vLLM connector moves, `refuse_unless_movable`)."""
        from transformers import AutoConfig, AutoTokenizer

        from ragkv.model.fingerprint import folder_fingerprint
        from ragkv.model.llm import tokenizer_fingerprint

        tokenizer = AutoTokenizer.from_pretrained(folder)
        try:
            layout: KVLayout | None = layout_of(AutoConfig.from_pretrained(folder))
        except ModelError:  # recurrent layers: only a loaded model describes them (the store recorded it)
            layout = None
        return cls(folder_fingerprint(Path(folder)), tokenizer_fingerprint(tokenizer), dtype, tokenizer, layout)

    @property
    def kv_layout_key(self) -> str:
        return self.layout.key if self.layout is not None else ""


def profile_for(store: str | Path, identity: ModelIdentity) -> Profile:
    """The store's profile whose KV this model computes: same weights, tokenizer, dtype, and a
    template that lays out the same prefix, and the cache layout its config states (a model with
    recurrent layers: the one the store recorded for these weights, which ragkv read off them).
    ModelError (one line) when there is none."""
    with open_snapshot(store, require_documents=False) as snapshot:
        rows = snapshot.catalog.entries.profiles()
        last = snapshot.catalog.meta().get("last_profile")
    fingerprint = identity.model_fingerprint
    matching = candidates(rows, last, fingerprint, identity.dtype)
    if identity.layout is not None:
        keys = [identity.kv_layout_key]
    else:
        keys = list(dict.fromkeys(row.kv_layout for row in matching if row.kv_layout))
    for key in keys:
        active = first_matching(matching, fingerprint, identity.tokenizer_fingerprint, identity.tokenizer, key)
        if active is not None:
            return active.profile
    held = ", ".join(sorted({f"{r.model_name} ({r.dtype})" for r in rows})) or "nothing"
    raise ModelError(
        f"store {store} holds no KV for this model in {identity.dtype} with this tokenizer (it holds "
        f"{held}); serve the model the store was built with, or ingest with this one"
    )


class StoreMatcher:
    """Matches prompt ids against the store at `store` under `profile`. Holds the published
    generation open (leased, so gc keeps its shards) and moves to a newer one between calls."""

    def __init__(
        self,
        store: str | Path,
        profile: Profile,
        separator_ids: Sequence[int] = (),
        tokenizer=None,
        fleet: PendingIndex | None = None,
    ):
        self.store = str(store)
        self.profile = profile
        self.separator_ids = tuple(separator_ids)
        self.tokenizer = tokenizer  # to check a chunk to save is its text's tokens (None: never save)
        self.fleet = fleet  # the KV other replicas left pending for the fold (None: not looked at)
        self.snapshot = open_snapshot(store, require_documents=False)
        self._load()

    def _load(self) -> None:
        catalog = self.snapshot.catalog
        self.prefix_entry = catalog.entries.entry(KVKey.for_prefix(self.profile).to_string())
        self.lengths = catalog.entries.entry_lengths(
            self.profile.profile_id
        )  # longest first: the longest continuation wins

    def refresh(self) -> None:
        if self.snapshot.latest_generation() != self.snapshot.generation:
            old, self.snapshot = self.snapshot, open_snapshot(self.store, require_documents=False)
            old.close()  # after: the new generation reuses the vector segments the old one loaded
            self._load()

    def match(self, prompt_ids: Sequence[int]) -> StoreMatch | None:
        """The stored KV of the prompt's leading prefix and chunk run, or None when the
        prompt does not start with the profile's prefix (or the store lacks its KV)."""
        self.refresh()
        prefix = self.profile.prefix_ids
        if self.prefix_entry is None or tuple(prompt_ids[: len(prefix)]) != prefix:
            return None
        entries, pos, key = [self.prefix_entry], len(prefix), None
        while True:
            found = self._next(prompt_ids, pos, key)
            if found is None:
                return StoreMatch(pos, tuple(entries))
            key, entry = found
            entries.append(entry)
            pos += entry.num_tokens

    def _next(self, prompt_ids: Sequence[int], pos: int, key: KVKey | None) -> tuple[KVKey, EntryRow] | None:
        """The longest stored entry continuing the prompt at `pos` (after `key`'s entry)."""
        candidates = spans.continuations(self.profile, key, prompt_ids, pos, self.lengths)
        catalog = self.snapshot.catalog
        for name in sorted(catalog.entries.existing_keys(candidates), key=lambda k: -len(candidates[k][1])):
            found_key, segment = candidates[name]
            stored = catalog.entries.token_ids_of(name)  # the chunk's own ids (a span segment: after its separator)
            chunk = segment if key is None else segment[len(self.separator_ids) :]
            entry = catalog.entries.entry(name) if stored is not None and list(stored) == chunk else None
            if entry is not None:
                return found_key, entry
        return None

    def plan(
        self, prompt_ids: Sequence[int], chunks: Sequence[LaidOutChunk], write_back: bool, match: StoreMatch
    ) -> RequestPlan:
        """The uses of `chunks` (laid out in `prompt_ids`, of which `match` is what the store
        holds), the match extended by what the fleet left pending of the chunks that follow it,
        and, with `write_back`, the chunks to save that neither holds (see `_missing`)."""
        refs = self.snapshot.catalog.documents.chunk_refs([c.chunk_id for c in chunks]) if chunks else {}
        missing: tuple[SaveTarget, ...] = ()
        if self.tokenizer is not None and (write_back or self.fleet is not None):
            missing = self._missing(prompt_ids, chunks, refs, match)
        match, missing = self._with_fleet(match, missing)
        saves = missing if write_back else ()
        saved = {t.chunk_id for t in saves}
        uses = []
        for chunk in chunks:
            if chunk.chunk_id not in refs:
                continue  # not a chunk of this generation (replaced meanwhile): no use to count
            doc_id, chunk_index, _ = refs[chunk.chunk_id]
            source = "store" if chunk.end <= match.num_tokens else "computed" if chunk.chunk_id in saved else "live"
            uses.append(Use(doc_id, chunk_index, source))
        return RequestPlan(tuple(uses), saves, match)

    def _with_fleet(
        self, match: StoreMatch, missing: tuple[SaveTarget, ...]
    ) -> tuple[StoreMatch, tuple[SaveTarget, ...]]:
        """`match` extended by the leading `missing` chunks another replica left pending (each
        with the prompt's own ids, right where the match ends), and the chunks still missing."""
        if self.fleet is None:
            return match, missing
        entries, pending, end, taken = list(match.entries), set(match.pending), match.num_tokens, 0
        for target in missing:
            found = self.fleet.lookup(target.kv_key) if target.start == end else None
            if found is None or found.token_ids != target.token_ids:
                break
            num_tokens = target.end - target.start
            entries.append(
                EntryRow(target.kv_key, found.shard, target.kv_key, num_tokens, self.profile.dtype, found.checksum, 0)
            )
            pending.add(target.kv_key)
            end, taken = target.end, taken + 1
        if not taken:
            return match, missing
        return StoreMatch(end, tuple(entries), frozenset(pending)), missing[taken:]

    def _missing(
        self, prompt_ids: Sequence[int], chunks: Sequence[LaidOutChunk], refs: dict, match: StoreMatch
    ) -> tuple[SaveTarget, ...]:
        """The prompt's leading chunks laid out as ingest computed them (a chunk alone, or a
        span's chunks from its start with separators between), from the first the store lacks
        on, each under the key ingest gives it: what to save. The run ends at a chunk whose ids in the prompt
        are not its link's (or its text's), and after a chunk stored alone; a prompt that opens
        inside a span saves nothing (that KV continues chunks the prompt lacks)."""
        from ragkv.model.prompt import encode_text

        targets: list[SaveTarget] = []
        key: KVKey | None = None
        before: tuple[str, int, int | None] | None = None  # the previous chunk's (doc, index, span)
        for chunk in chunks:
            if chunk.chunk_id not in refs:
                break
            doc_id, chunk_index, text = refs[chunk.chunk_id]
            link = self.snapshot.catalog.entries.chunk_link(chunk.chunk_id, self.profile.profile_id)
            span_start = link.span_start if link is not None else None
            if before is None and span_start not in (None, chunk_index):
                break
            if before is not None and (
                span_start in (None, chunk_index) or before != (doc_id, chunk_index - 1, span_start)
            ):
                break
            start = chunk.start if before is None else chunk.start - len(self.separator_ids)
            token_ids = tuple(prompt_ids[chunk.start : chunk.end])
            known = link.token_ids if link is not None else tuple(encode_text(self.tokenizer, text))
            if token_ids != known or tuple(prompt_ids[start : chunk.start]) != (
                () if before is None else self.separator_ids
            ):
                break
            parent, key = key, spans.next_key(self.profile, key, prompt_ids[start : chunk.end])
            if start >= match.num_tokens:
                targets.append(
                    SaveTarget(
                        key.to_string(),
                        chunk.chunk_id,
                        token_ids,
                        start,
                        chunk.end,
                        span_start,
                        None if parent is None else parent.to_string(),
                    )
                )
            if span_start is None:
                break  # a chunk stored alone: what follows it was computed after it
            before = (doc_id, chunk_index, span_start)
        return tuple(targets)

    def close(self) -> None:
        self.snapshot.close()
