"""The packed step's forward written out for decoder layers of the Llama kind (Llama, SmolLM2,
Qwen2, Qwen3): the model's own modules and its family's own rotary function, called in the
order transformers calls them, without what transformers wraps around each call (argument
deprecation and output capture per layer, the cache's and the attention's dispatch, the mask
preparation a packed step does not use). The same operations on the same tensors: the logits
are bitwise those of the model's own forward (tested per family), in 3-10% less time a step on
a 2-core CPU (benchmarks/results/decode_profile.md; the step is mostly reading weights and KV
from memory). Any other family takes the model's own forward (`serves` says which). Only a
packable model (ragkv.kv.packed) takes packed steps at all.
"""

from __future__ import annotations

import sys

import torch

from ragkv.kv.packed import Packing, attend_packed

# Decoder layers whose forward `_layer` repeats, operation for operation (transformers 5.x):
# norm, q/k/v projections (Qwen3: a norm on q and k per head), rotary, the cache's update,
# attention, o projection, residual; norm, MLP, residual.
_LLAMA_KIND = {"LlamaDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer"}


def serves(model) -> bool:
    """Whether `forward` computes `model`'s packed step: a causal LM whose every decoder layer
    is of the Llama kind, its model under `.model` with the embedding, rotary and final norm."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not all(hasattr(inner, name) for name in ("embed_tokens", "rotary_emb", "norm")):
        return False
    return hasattr(model, "lm_head") and all(type(layer).__name__ in _LLAMA_KIND for layer in layers)


@torch.inference_mode()
def forward(model, ids: torch.Tensor, packing: Packing, slots) -> torch.Tensor:
    """The packed step of `ids` `(1, N)` laid out by `packing`, each layer's keys and values
    written into its slot layer's buffers in `slots` (the `RaggedBatch`'s); returns each row's
    logits after its last token `(B, V)`. Tokens run as `(N, hidden)` and heads as `(N, H, D)`
    (transformers' `(1, H, N, D)` costs a transpose and a copy per layer; the values are the same)."""
    inner = model.model
    hidden = inner.embed_tokens(ids[0])  # (N, hidden)
    cos, sin = (t[0] for t in inner.rotary_emb(hidden[None], position_ids=packing.positions))  # (N, D) each
    for layer, slot in zip(inner.layers, slots, strict=True):
        hidden = _layer(layer, hidden, cos, sin, slot, packing)
    hidden = inner.norm(hidden)[packing.last]  # (B, hidden): the norm of every token, as the model's
    return model.lm_head(hidden)


def _layer(layer, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slot, packing: Packing):
    attention = layer.self_attn
    rotary = sys.modules[type(attention).__module__].apply_rotary_pos_emb
    normed = layer.input_layernorm(hidden)
    shape = (hidden.shape[0], -1, attention.head_dim)  # (N, heads, D)
    query = attention.q_proj(normed).view(shape)
    key = attention.k_proj(normed).view(shape)
    if hasattr(attention, "q_norm"):  # Qwen3
        query, key = attention.q_norm(query), attention.k_norm(key)
    query, key = rotary(query, key, cos, sin)  # cos/sin (N, 1, D) against (N, heads, D)
    keys, values = slot.put_packed(key, attention.v_proj(normed).view(shape))  # the whole buffers
    out = attend_packed(query, keys, values, packing, attention.scaling)  # (N, heads, D)
    hidden = hidden + attention.o_proj(out.view(hidden.shape[0], -1))
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden))
