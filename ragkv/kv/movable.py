"""Which model layouts ragkv's vLLM connector moves exactly, read off a config alone (the
connector runs in vLLM's processes, which hold no transformers model of their own): attention
layers of one shape, full or sliding, and Mamba2 layers beside them, whose stored state it loads.
Checked before vLLM starts, by `serve --engine vllm`, `ingest --engine vllm` and the connector."""

from __future__ import annotations

from ragkv.core.errors import ModelError
from ragkv.kv.layout import ATTENTION_LAYERS, STATE_LAYER_KINDS, layout_of, model_class

# Families whose recurrent layers are Mamba2, which vLLM keeps as a conv window and a state
# matrix of transformers' shapes: the vLLM connector loads their stored state (it saves none).
MAMBA2_FAMILIES = ("nemotron_h", "falcon_h1", "granitemoehybrid", "bamba", "zamba2")


def not_movable(config, saves: bool = False) -> str | None:
    """Why ragkv's vLLM connector cannot move a model's KV exactly (by its config alone, no
    weights), in words; None when it can: every layer caching keys and values of one shape, full
    attention or sliding windows (vLLM keeps a sliding layer's window; the store, what a
    continuation reads of it), and Mamba2 layers beside them, whose stored state it loads
    (`saves`: when it must also save, it cannot: the state at a chunk's end is gone by the end
    of the step that computes the prompt)."""
    from transformers import DynamicCache

    name = model_class(config)
    text = config.get_text_config()
    if getattr(text, "kv_lora_rank", None):
        return f"{name} caches a latent (multi-head latent attention)"
    others = {type(layer).__name__ for layer in DynamicCache(config=config).layers} - set(ATTENTION_LAYERS)
    recurrent = others & set(STATE_LAYER_KINDS)
    # beside a Mamba2 family's state layers, a layer without cache is an MLP or MoE block, which
    # vLLM holds nothing for either (elsewhere it reads another layer's KV: Gemma 4, refused below)
    if recurrent and getattr(text, "model_type", "") in MAMBA2_FAMILIES and others <= recurrent | {"DummyLayer"}:
        return f"{name} keeps a Mamba2 state, which vLLM computes only to the end of a step" if saves else None
    if others:
        return f"{name} keeps recurrent state or has layers without KV ({', '.join(sorted(others))})"
    try:
        layout_of(config)
    except Exception:  # transformers refuses one head size for layers whose configs differ (Gemma 4)
        return f"{name} caches keys and values of several shapes"
    return None


def refuse_unless_movable(folder, saves: bool = False) -> None:
    """ModelError, in one line, for a model that the vLLM connector cannot move exactly
    (`not_movable`). The connector moves each layer's KV through vLLM's paged blocks of one
    shape, and loads a Mamba2 layer's state into vLLM's; a latent, other recurrent states and
    layers of other shapes live in vLLM in blocks of other kinds. ragkv's own engine serves
    those models."""
    from transformers import AutoConfig

    problem = not_movable(AutoConfig.from_pretrained(folder), saves)
    if problem is not None:
        raise ModelError(
            "the ragkv vLLM connector moves KV of attention layers of one shape (full or sliding) and loads Mamba2 "
            f"states, and {problem}: use ragkv's own engine (ragkv ingest/ask/serve without --engine vllm)"
        )
