"""Cache identity: what a stored KV entry is the KV *of*.

A chunk's KV depends on the model weights and config, on the token ids before it (the chat
template and system prompt, which also fix its positions), on the dtype and quantisation
it was computed and stored in, and on its own token ids. `Profile` holds everything but the
chunk's own tokens; its digest is the root of a blake2b chain, and each entry's key is
`H(root || kind || token bytes)`. Keys never use Python's `hash()`: they must agree across
processes and machines.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from ragkv.core.errors import StoreFormatError
from ragkv.core.formats import KEY_FORMAT

_DIGEST_SIZE = 32


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as pinned-width little-endian uint32 bytes (stable across platforms)."""
    return np.asarray(token_ids, dtype="<u4").tobytes()


def digest(*fields: bytes | str) -> str:
    """blake2b-256 over length-prefixed fields (so ("ab","c") != ("a","bc")), as hex."""
    h = hashlib.blake2b(digest_size=_DIGEST_SIZE)
    for field in fields:
        data = field.encode() if isinstance(field, str) else field
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def file_digest(paths: Iterable[str | os.PathLike], chunk_bytes: int = 1 << 22) -> str:
    """blake2b-256 over the names and bytes of files, in the order given."""
    h = hashlib.blake2b(digest_size=_DIGEST_SIZE)
    for path in paths:
        h.update(str(path).rsplit("/", 1)[-1].encode())
        with open(path, "rb") as f:
            while block := f.read(chunk_bytes):
                h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class Profile:
    """Everything except a chunk's own tokens that changes its KV. Built from model facts only."""

    model_fingerprint: str  # config + weights
    tokenizer_fingerprint: str
    template_fingerprint: str  # chat template + system prompt text
    prefix_ids: tuple[int, ...]  # the token ids every chunk is computed after (fixes positions)
    dtype: str  # compute and storage dtype, e.g. "float32"
    kv_quant: str = "none"  # storage quantisation of the KV
    # What the cache holds per layer, when it is not every layer full attention of one width
    # (ragkv.kv.layout.KVLayout.key: sliding windows, a latent). Hashed only when set, so the
    # profiles of plain models keep the ids they had before layouts were recorded.
    kv_layout: str = ""

    @property
    def profile_id(self) -> str:
        """The chain root: stable hex digest of every field."""
        return digest(
            f"ragkv-profile-v{KEY_FORMAT}",
            self.model_fingerprint,
            self.tokenizer_fingerprint,
            self.template_fingerprint,
            token_bytes(self.prefix_ids),
            self.dtype,
            self.kv_quant,
            *([self.kv_layout] if self.kv_layout else []),
        )

    @property
    def num_prefix_tokens(self) -> int:
        return len(self.prefix_ids)

    @classmethod
    def from_row(
        cls, row, model_fingerprint: str, tokenizer_fingerprint: str, layout, kv_layout: str = ""
    ) -> Profile | None:
        """The profile a loaded model (its fingerprints, its `kv_layout` key, and `layout`: the
        prompt layout its tokenizer builds from `row.system_prompt`) computes for a stored
        profile `row`; None when it is not that profile (other weights, tokenizer, template or
        KV layout)."""
        profile = cls.of_layout(model_fingerprint, tokenizer_fingerprint, layout, row.dtype, row.kv_quant, kv_layout)
        return profile if profile.profile_id == row.profile_id else None

    @classmethod
    def of_layout(
        cls,
        model_fingerprint: str,
        tokenizer_fingerprint: str,
        layout,
        dtype: str,
        kv_quant: str = "none",
        kv_layout: str = "",
    ) -> Profile:
        """The profile of a model (its fingerprints and KV layout key) laying out prompts as
        `layout` (a ragkv.model.prompt.PromptLayout: its template and prefix), computing in `dtype`."""
        prefix = tuple(layout.prefix_ids)
        return cls(
            model_fingerprint, tokenizer_fingerprint, layout.template_fingerprint, prefix, dtype, kv_quant, kv_layout
        )


@dataclass(frozen=True)
class KVKey:
    """Identity of one stored KV entry: the profile root and the digest of what follows it."""

    profile_id: str
    entry_digest: str

    @classmethod
    def for_prefix(cls, profile: Profile) -> KVKey:
        """Key of the shared prefix (system prompt and template head) KV."""
        return cls.prefix_of(profile.profile_id)

    @classmethod
    def prefix_of(cls, profile_id: str) -> KVKey:
        """Key of the prefix KV of the profile whose root is `profile_id`."""
        return cls(profile_id, digest(profile_id, "prefix"))

    @property
    def is_prefix(self) -> bool:
        return self == KVKey.prefix_of(self.profile_id)

    @classmethod
    def for_chunk(cls, profile: Profile, chunk_ids: Sequence[int]) -> KVKey:
        """Key of a chunk's KV, computed right after the profile's prefix."""
        root = profile.profile_id
        return cls(root, digest(root, "chunk", token_bytes(chunk_ids)))

    def then(self, segment_ids: Sequence[int]) -> KVKey:
        """Key of the KV of `segment_ids` computed right after the entry this key names (and
        all that came before it): a document's next chunk in a span, separator included.
        The chain covers every token before the segment, so an edit anywhere earlier in the
        span changes every later key."""
        return KVKey(self.profile_id, digest(self.profile_id, "then", self.entry_digest, token_bytes(segment_ids)))

    def to_string(self) -> str:
        return f"kv{KEY_FORMAT}:{self.profile_id}:{self.entry_digest}"

    @classmethod
    def from_string(cls, text: str) -> KVKey:
        parts = text.split(":")
        if len(parts) != 3 or parts[0] != f"kv{KEY_FORMAT}":
            raise StoreFormatError(
                f"not a ragkv KV key: {text[:80]!r} (a store written by another ragkv version, "
                "or a damaged catalog: run ragkv verify)"
            )
        return cls(parts[1], parts[2])
