"""Which stored profile an engine answers with: the model named (or the store's last one),
loaded and checked against what the store was built with."""

from __future__ import annotations

from ragkv.core.cpu import run_aside
from ragkv.core.errors import ModelError, StoreEmptyError
from ragkv.kv import codec
from ragkv.model import self_check
from ragkv.model.device import resolve_dtype
from ragkv.model.embed import Embedder, EmbedPrompts
from ragkv.model.llm import LoadedModel, load_model, model_name
from ragkv.model.profiles import ActiveProfile, candidates, first_matching
from ragkv.store import StoreSnapshot

__all__ = ["ActiveProfile", "open_embedder", "open_model"]


def open_model(
    snapshot: StoreSnapshot,
    name: str | None,
    device: str,
    dtype: str | None,
    kv_dtype: str | None,
    weights: bool = True,
    loaded: LoadedModel | None = None,
) -> tuple[LoadedModel, ActiveProfile]:
    """Load the model `name` (default: the one the store was last ingested with) in `dtype`
    and pick its stored profile (KV stored as `kv_dtype`, when given). Raises StoreEmptyError
    or ModelError, naming what the store holds, when there is none to answer with. `loaded`:
    a model another store's engine loaded, used instead of loading one (one copy in memory)."""
    if loaded is not None:
        name, dtype = loaded.facts.name, loaded.facts.dtype
    rows = snapshot.catalog.entries.profiles()
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
    lm = loaded or load_model(name, device, dtype, weights)
    quant = codec.kv_quant(kv_dtype, dtype) if kv_dtype is not None else None
    matching = candidates(rows, last, lm.facts.fingerprint, dtype, quant)
    if not matching:
        raise no_kv()
    facts = lm.facts
    active = first_matching(matching, facts.fingerprint, facts.tokenizer_fingerprint, lm.tokenizer, facts.kv_layout_key)
    if active is None:
        raise ModelError(
            f"model {name}'s tokenizer or chat template differs from when store {snapshot.location} was built; "
            "re-run ragkv ingest to recompute the KV"
        )
    if lm.model is not None:  # a profile not checked on this machine is checked now (raises when not exact)
        row = next(r for r in rows if r.profile_id == active.profile.profile_id)
        run_aside(self_check.check_once, lm, row.profile_id, row.self_check)
    return lm, active


def open_embedder(snapshot: StoreSnapshot, name: str | None, device: str) -> Embedder:
    """The embedder the store was built with (`name` must be it, when given)."""
    meta = snapshot.catalog.meta()
    embedder = Embedder.load(name or meta["embedder"], device, EmbedPrompts.from_meta(meta.get("embedder_prompts")))
    if embedder.fingerprint != meta.get("embedder_fingerprint"):
        raise ModelError(
            f"embedder {name} differs from the one store {snapshot.location} was built with "
            f"({meta.get('embedder')}); omit --embedder"
        )
    return embedder
