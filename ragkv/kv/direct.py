"""The packed step's forward written out for decoder layers of the Llama kind (Llama, SmolLM2,
Qwen2, Qwen3): the model's own weights, its family's own rotary function, and the arithmetic of
its norms and projections, in the order transformers calls them, without what transformers
wraps around each call (module calls, argument deprecation and output capture per layer, the
cache's and the attention's dispatch, the mask preparation a packed step does not use). The
same operations on the same tensors: the logits are bitwise those of the model's own forward
(tested per family), in 3-10% less time a step on a 2-core CPU
(benchmarks/results/decode_profile.md; the step is mostly reading weights and KV from memory).
Any other family, or a model whose projections are not plain `nn.Linear`s, takes the model's
own forward (`serves` says which). Only a packable model (ragkv.kv.packed) takes packed steps
at all.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from ragkv.kv.packed import Packing, attend_packed

# Decoder layers whose forward `_layer` repeats, operation for operation (transformers 5.x):
# norm, q/k/v projections (Qwen3: a norm on q and k per head), rotary, the cache's update,
# attention, o projection, residual; norm, MLP, residual.
_LLAMA_KIND = {"LlamaDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer"}
_NORMS = {"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"}  # what `_norm` computes


def serves(model) -> bool:
    """Whether `forward` computes `model`'s packed step: a causal LM whose every decoder layer
    is of the Llama kind, its model under `.model` with the embedding, rotary and final norm."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if inner is None or layers is None or not all(hasattr(inner, n) for n in ("embed_tokens", "rotary_emb", "norm")):
        return False
    if not (hasattr(model, "lm_head") and all(type(layer).__name__ in _LLAMA_KIND for layer in layers)):
        return False
    return _plain([model.lm_head], [inner.norm]) and all(_plain(*_parts(layer)) for layer in layers)


def _parts(layer) -> tuple[list, list]:
    """A decoder layer's linear projections and its norms."""
    attention, mlp = layer.self_attn, layer.mlp
    linears = [attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj]
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    norms += [getattr(attention, name) for name in ("q_norm", "k_norm") if hasattr(attention, name)]
    return linears + [mlp.gate_proj, mlp.up_proj, mlp.down_proj], norms


def _plain(linears: list, norms: list) -> bool:
    """Whether `_linear` and `_norm` compute these modules' forwards: plain `nn.Linear`s (not a
    quantised or adapted subclass) and the Llama kind's RMSNorm."""
    return all(type(m) is torch.nn.Linear for m in linears) and all(type(n).__name__ in _NORMS for n in norms)


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
    hidden = _norm(inner.norm, hidden)[packing.last]  # (B, hidden): the norm of every token, as the model's
    return _linear(model.lm_head, hidden)


def _layer(layer, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slot, packing: Packing):
    attention, mlp = layer.self_attn, layer.mlp
    rotary = sys.modules[type(attention).__module__].apply_rotary_pos_emb
    normed = _norm(layer.input_layernorm, hidden)
    shape = (hidden.shape[0], -1, attention.head_dim)  # (N, heads, D)
    query = _linear(attention.q_proj, normed).view(shape)
    key = _linear(attention.k_proj, normed).view(shape)
    if hasattr(attention, "q_norm"):  # Qwen3
        query, key = _norm(attention.q_norm, query), _norm(attention.k_norm, key)
    query, key = rotary(query, key, cos, sin)  # cos/sin (N, 1, D) against (N, heads, D)
    keys, values = slot.put_packed(key, _linear(attention.v_proj, normed).view(shape))  # the whole buffers
    out = attend_packed(query, keys, values, packing, attention.scaling)  # (N, heads, D)
    hidden = hidden + _linear(attention.o_proj, out.view(hidden.shape[0], -1))
    normed = _norm(layer.post_attention_layernorm, hidden)
    return hidden + _linear(mlp.down_proj, mlp.act_fn(_linear(mlp.gate_proj, normed)) * _linear(mlp.up_proj, normed))


def _linear(module, x: torch.Tensor) -> torch.Tensor:
    """`module(x)` for an `nn.Linear`, without the module call."""
    return F.linear(x, module.weight, module.bias)


def _norm(module, x: torch.Tensor) -> torch.Tensor:
    """`module(x)` for the Llama kind's RMSNorm (Llama's, Qwen2's and Qwen3's forward, operation
    for operation: the mean of squares in float32, the weight applied in the input's dtype)."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)
    return module.weight * x.to(dtype)
