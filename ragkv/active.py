"""Which stored profile an engine answers with: the model named (or the store's last one),
loaded and checked against what the store was built with."""

from __future__ import annotations

from dataclasses import dataclass

from ragkv import codec
from ragkv.config import resolve_dtype
from ragkv.embed import Embedder
from ragkv.errors import ModelError, StoreEmptyError
from ragkv.keys import Profile
from ragkv.model import LoadedModel, load_model, model_name
from ragkv.prompt import PromptLayout
from store import StoreSnapshot


@dataclass(frozen=True)
class ActiveProfile:
    """The stored profile an engine answers with, checked against the live model."""

    profile: Profile
    layout: PromptLayout
    system_prompt: str


def open_model(
    snapshot: StoreSnapshot,
    name: str | None,
    device: str,
    dtype: str | None,
    kv_dtype: str | None,
    weights: bool = True,
) -> tuple[LoadedModel, ActiveProfile]:
    """Load the model `name` (default: the one the store was last ingested with) in `dtype`
    and pick its stored profile (KV stored as `kv_dtype`, when given). Raises StoreEmptyError
    or ModelError, naming what the store holds, when there is none to answer with."""
    rows = snapshot.catalog.profiles()
    if not rows:
        raise StoreEmptyError(f"store {snapshot.location} holds no KV; add documents with: ragkv ingest DOCS")
    last = snapshot.catalog.meta().get("last_profile")
    default = next((r for r in rows if r.profile_id == last), rows[0])
    name = model_name(name) if name else default.model_name
    same_name = [r for r in rows if r.model_name == name]
    dtype = resolve_dtype(dtype, device) if dtype else (same_name[0].dtype if same_name else default.dtype)
    if kv_dtype is not None and not any(r.kv_quant == codec.kv_quant(kv_dtype, dtype) for r in same_name or rows):
        held = ", ".join(sorted({r.kv_quant for r in same_name or rows}))
        raise ModelError(
            f"store {snapshot.location} holds no KV stored as {kv_dtype} for {name} (it holds: "
            f"{held}; 'none' is lossless); omit --kv-dtype, or ingest with --kv-dtype {kv_dtype}"
        )

    def no_kv() -> ModelError:
        held = ", ".join(sorted({f"{r.model_name} ({r.dtype}, KV {r.kv_quant})" for r in rows}))
        return ModelError(
            f"store {snapshot.location} has no KV for model {name} in {dtype}"
            f"{f' stored as {kv_dtype}' if kv_dtype else ''} (it holds: {held}); "
            f"ingest with --model {name} --dtype {dtype}, or omit --model"
        )

    if not any(r.dtype == dtype for r in rows):  # said before the weights load, not after
        raise no_kv()
    lm = load_model(name, device, dtype, weights)
    candidates = [
        r
        for r in rows
        if r.model_fingerprint == lm.facts.fingerprint
        and r.dtype == dtype
        and (kv_dtype is None or r.kv_quant == codec.kv_quant(kv_dtype, dtype))
    ]
    if not candidates:
        raise no_kv()
    row = next((r for r in candidates if r.profile_id == last), candidates[0])
    layout = PromptLayout.build(lm.tokenizer, row.system_prompt)
    profile = Profile.from_row(row, lm.facts.fingerprint, lm.facts.tokenizer_fingerprint, layout)
    if profile is None:
        raise ModelError(
            f"model {name}'s tokenizer or chat template differs from when store {snapshot.location} was built; "
            "re-run ragkv ingest to recompute the KV"
        )
    return lm, ActiveProfile(profile, layout, row.system_prompt)


def open_embedder(snapshot: StoreSnapshot, name: str | None, device: str) -> Embedder:
    """The embedder the store was built with (`name` must be it, when given)."""
    meta = snapshot.catalog.meta()
    embedder = Embedder.load(name or meta["embedder"], device)
    if embedder.fingerprint != meta.get("embedder_fingerprint"):
        raise ModelError(
            f"embedder {name} differs from the one store {snapshot.location} was built with "
            f"({meta.get('embedder')}); omit --embedder"
        )
    return embedder
