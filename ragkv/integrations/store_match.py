"""What a ragkv store holds of a prompt given as token ids: the engine-neutral half of a KV
connector (vLLM's lives in ragkv.integrations.vllm).

A prompt ragkv laid out starts with its profile's prefix ids (chat template head and system
prompt), then a chunk, then, for a chunk that starts a span, the chunks that continue it.
Those are the tokens whose stored KV sits at exactly the positions the prompt puts them, so
only they are matched. The match walks ragkv's key chain: for each chunk length the store
holds, the key of the next tokens is computed and looked up; a key found is accepted only
after its stored token ids are compared with the prompt's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from ragkv import codec, kv
from ragkv.errors import ModelError
from ragkv.keys import KVKey, Profile
from store import EntryRow, open_snapshot
from store.shards import ShardReader


@dataclass(frozen=True)
class StoreMatch:
    """The leading prompt tokens whose KV the store holds, and the entries holding them in
    order: the prefix's, then each chunk's (or span segment's)."""

    num_tokens: int
    entries: tuple[EntryRow, ...]


@dataclass(frozen=True)
class ModelIdentity:
    """What a serving engine runs, as ragkv keys KV: weights, tokenizer and dtype."""

    model_fingerprint: str
    tokenizer_fingerprint: str
    dtype: str
    tokenizer: object  # to rebuild the prompt layout (template and system prompt) of a profile

    @classmethod
    def of_folder(cls, folder: str | Path, dtype: str) -> "ModelIdentity":
        from transformers import AutoTokenizer

        from ragkv.fingerprint import folder_fingerprint
        from ragkv.model import tokenizer_fingerprint

        tokenizer = AutoTokenizer.from_pretrained(folder)
        return cls(folder_fingerprint(Path(folder)), tokenizer_fingerprint(tokenizer), dtype, tokenizer)


def profile_for(store: str | Path, identity: ModelIdentity) -> Profile:
    """The store's profile whose KV this model computes: same weights, tokenizer, dtype, and a
    template that lays out the same prefix. ModelError (one line) when there is none."""
    from ragkv.prompt import PromptLayout

    with open_snapshot(store, require_documents=False) as snapshot:
        rows = snapshot.catalog.profiles()
        last = snapshot.catalog.meta().get("last_profile")
    rows.sort(key=lambda r: r["profile_id"] != last)
    for row in rows:
        if row["model_fingerprint"] != identity.model_fingerprint or row["dtype"] != identity.dtype:
            continue
        layout = PromptLayout.build(identity.tokenizer, row["system_prompt"])
        profile = Profile(identity.model_fingerprint, identity.tokenizer_fingerprint, layout.template_fingerprint,
                          layout.prefix_ids, identity.dtype, row["kv_quant"])
        if profile.profile_id == row["profile_id"]:
            return profile
    held = ", ".join(sorted({f"{r['model_name']} ({r['dtype']})" for r in rows})) or "nothing"
    raise ModelError(f"store {store} holds no KV for this model in {identity.dtype} with this tokenizer (it holds "
                     f"{held}); serve the model the store was built with, or ingest with this one")


class StoreMatcher:
    """Matches prompt ids against the store at `store` under `profile`. Holds the published
    generation open (leased, so gc keeps its shards) and moves to a newer one between calls."""

    def __init__(self, store: str | Path, profile: Profile, separator_ids: Sequence[int] = ()):
        self.store = str(store)
        self.profile = profile
        self.separator_ids = tuple(separator_ids)
        self.snapshot = open_snapshot(store, require_documents=False)
        self._load()

    def _load(self) -> None:
        catalog = self.snapshot.catalog
        self.prefix_entry = catalog.entry(KVKey.for_prefix(self.profile).to_string())
        rows = catalog.con.execute(
            "SELECT DISTINCT num_tokens FROM kv_entries WHERE profile_id = ? AND kind = 'chunk' ORDER BY 1 DESC",
            [self.profile.profile_id]).fetchall()
        self.lengths = [r[0] for r in rows]  # longest first: the longest stored continuation wins

    def refresh(self) -> None:
        if self.snapshot.latest_generation() != self.snapshot.generation:
            self.snapshot.close()
            self.snapshot = open_snapshot(self.store, require_documents=False)
            self._load()

    def match(self, prompt_ids: Sequence[int]) -> StoreMatch | None:
        """The stored KV of the prompt's leading prefix and chunk run, or None when the
        prompt does not start with the profile's prefix (or the store lacks its KV)."""
        self.refresh()
        prefix = self.profile.prefix_ids
        if self.prefix_entry is None or tuple(prompt_ids[:len(prefix)]) != prefix:
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
        candidates = {}
        for n in self.lengths:
            if pos + n > len(prompt_ids):
                continue
            segment = list(prompt_ids[pos:pos + n])
            next_key = KVKey.for_chunk(self.profile, segment) if key is None else key.then(segment)
            candidates[next_key.to_string()] = (next_key, segment)
        catalog = self.snapshot.catalog
        for name in sorted(catalog.existing_keys(candidates), key=lambda k: -len(candidates[k][1])):
            next_key, segment = candidates[name]
            stored = catalog.token_ids_of(name)  # the chunk's own ids (a span segment: after its separator)
            chunk = segment if key is None else segment[len(self.separator_ids):]
            if stored is not None and list(stored) == chunk:
                return next_key, catalog.entry(name)
        return None

    def close(self) -> None:
        self.snapshot.close()


def load_kv(shards: ShardReader, entries: Sequence[EntryRow], dtype: torch.dtype) -> torch.Tensor:
    """The entries' KV joined along the tokens, `(L, 2, H, T, D)` in `dtype`, each verified."""
    parts = [codec.decode(shards.read_parts(e.shard, e.tensor, e.checksum), dtype) for e in entries]
    return torch.cat(parts, dim=kv.TOKEN_DIM)


def slot_mapping(block_ids: Sequence[int], block_size: int, start: int, end: int) -> torch.Tensor:
    """Paged-cache slots of token positions start..end-1: block `p // block_size` of the
    request's blocks, offset `p % block_size`. `(end - start,)` int64."""
    positions = torch.arange(start, end)
    blocks = torch.tensor(list(block_ids), dtype=torch.long)[positions // block_size]
    return blocks * block_size + positions % block_size
