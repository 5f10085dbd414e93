"""The packed step's forward written out for decoder layers of the Llama kind (Llama, SmolLM2,
Qwen2, Qwen3): the model's own weights, and the arithmetic of its norms, projections and
rotary embedding (query and key heads rotated together, element for element as the family's
`apply_rotary_pos_emb` does), in the order transformers calls them, without what transformers
wraps around each call (module calls, argument deprecation and output capture per layer, the
cache's and the attention's dispatch, the mask preparation a packed step does not use). The
same operations on the same tensors: the logits are bitwise those of the model's own forward
(tested per family), in 3-10% less time a step on a 2-core CPU
(benchmarks/results/decode_profile.md; the step is mostly reading weights and KV from memory).
One exception, for speed: a step of 5-16 tokens of a small float32 model on a CPU multiplies by
MKL's packed weights (PACKED_ROWS below), which agree to float rounding, not to the bit.
Any other family, or a model whose projections are not plain `nn.Linear`s, takes the model's
own forward (`serves` says which). Only a packable model (ragkv.kv.packed) takes packed steps
at all.
"""

from __future__ import annotations

import threading
import weakref
from functools import partial

import torch
import torch.nn.functional as F

from ragkv.kv.cache import GrowingLayer
from ragkv.kv.packed import Packing, attend_packed

# Decoder layers whose forward `_layer` repeats, operation for operation (transformers 5.x):
# norm, q/k/v projections (Qwen3: a norm on q and k per head), rotary, the cache's update,
# attention, o projection, residual; norm, MLP, residual.
_LLAMA_KIND = {"LlamaDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer"}
_NORMS = {"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"}  # what `_norm` computes

# A step of 5-16 tokens (up to 16 decoding rows) runs its projections through MKL's packed copies
# of the weights, made for 8 rows (steps of 5-8 tokens) and for 16 (9-16); a step of fewer is
# padded with zero rows, their outputs dropped. MKL's plain sgemm computes a few rows at a
# fraction of the speed the weights stream from memory; packed (cblas_sgemm_pack; vLLM's CPU
# build prepacks through oneDNN) SmolLM2-135M's 211 projections at 8 rows took 38 against 52 ms
# on 2 cores, and its whole 8-row step 87.5 against 103.5 ms (7 rows: 86.1 against 98.6); the
# whole step at 16 rows 117.3 against 135.8 ms, at 12 rows 105.6 against 123.7. A step of 8
# rows padded to 16 gains nothing: a copy is made for the rows it computes.
# Each copy costs as much memory as the weights, made at the first step of its size, so only a
# model whose projections weigh at most PACK_LIMIT gets them (SmolLM2-135M: +539 MB each, made
# in ~0.2 s); float32 on a CPU with MKL only. Rows agree with the plain sgemm's to float rounding
# (~1e-4 in the logits; tested), not bitwise.
PACKED_ROWS = (8, 16)
FEWEST_PACKED = 5  # fewer tokens: the plain sgemm is as fast as the padded packed one
PACK_LIMIT = 1 << 30  # bytes


def serves(model) -> bool:
    """Whether `forward` computes `model`'s packed step: a causal LM whose every decoder layer
    is of the Llama kind, its model under `.model` with the embedding, rotary and final norm.
    Decided once per model, as its packs are (a walk over every layer's modules took ~370 us,
    asked every step; ragkv never swaps a loaded model's modules)."""
    return _decided(_SERVED, model, _served)


def _served(model) -> bool:
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
    packs = packs_of(model)
    for layer, slot in zip(inner.layers, slots, strict=True):
        attend = partial(_attend_slot, slot, packing)
        hidden = _layer(layer, hidden, cos, sin, attend, packs)
    hidden = _norm(inner.norm, hidden)[packing.last]  # (B, hidden): the norm of every token, as the model's
    return _linear(model.lm_head, hidden, packs)


def _attend_slot(slot, packing: Packing, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling):
    """A packed step's attention: `key`/`value` `(N, KV, D)` written into `slot`, `query`
    `(N, H, D)` attending over its row of the slot's buffers."""
    keys, values = slot.put_packed(key, value)  # the whole buffers
    return attend_packed(query, keys, values, packing, scaling)


def serves_alone(model, cache) -> bool:
    """Whether `step_alone` computes `model`'s step on `cache`: `serves(model)`, and `cache`
    a batch-1 cache of attention layers that grow in place (ragkv.kv.cache.GrowingLayer)."""
    layers = getattr(cache, "layers", ())
    return bool(layers) and all(type(layer) is GrowingLayer for layer in layers) and serves(model)


@torch.inference_mode()
def step_alone(model, token: int, cache) -> torch.Tensor:
    """Feed one token on `cache` (`serves_alone`), its keys and values appended in place; returns
    the next position's logits `(V,)`: bitwise the packed step of that one row (`forward`;
    tested), without its layout (no packing, mask or gathering: one row attends over its whole
    cache), ~5% less time a step on 2 cores. To float rounding, not bitwise, the model's own step:
    its attention groups the query heads per key head, as the batch's does."""
    inner, length = model.model, cache.get_seq_length()
    ids = torch.tensor([token], dtype=torch.long, device=model.device)
    hidden = inner.embed_tokens(ids)  # (1, hidden)
    positions = torch.tensor([[length]], dtype=torch.long, device=model.device)
    cos, sin = (t[0] for t in inner.rotary_emb(hidden[None], position_ids=positions))  # (1, D) each
    for layer, cache_layer in zip(inner.layers, cache.layers, strict=True):
        hidden = _layer(layer, hidden, cos, sin, partial(_attend_alone, cache_layer), None)
    return _linear(model.lm_head, _norm(inner.norm, hidden), None)[0]


def _attend_alone(cache_layer: GrowingLayer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling):
    """One token's attention over its growing layer, `key`/`value` `(1, KV, D)` appended first:
    each key head's query heads as its queries, over every column (nothing to mask)."""
    keys, values = cache_layer.update(key.transpose(0, 1)[None], value.transpose(0, 1)[None])  # (1, KV, T, D)
    grouped = query.view(1, keys.shape[1], -1, query.shape[2])  # (1, KV, H/KV, D)
    attended = F.scaled_dot_product_attention(grouped, keys, values, scale=scaling)
    return attended.view(1, -1, query.shape[2])


def _layer(layer, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend, packs):
    """One decoder layer on `hidden` `(N, hidden)`; `attend(query, key, value, scaling)` writes
    the keys and values where they are kept and returns the attention `(N, H, D)`."""
    attention, mlp = layer.self_attn, layer.mlp
    normed = _norm(layer.input_layernorm, hidden)
    shape = (hidden.shape[0], -1, attention.head_dim)  # (N, heads, D)
    query = _linear(attention.q_proj, normed, packs).view(shape)
    key = _linear(attention.k_proj, normed, packs).view(shape)
    if hasattr(attention, "q_norm"):  # Qwen3
        query, key = _norm(attention.q_norm, query), _norm(attention.k_norm, key)
    query, key = _rotated(query, key, cos, sin)
    out = attend(query, key, _linear(attention.v_proj, normed, packs).view(shape), attention.scaling)
    hidden = hidden + _linear(attention.o_proj, out.view(hidden.shape[0], -1), packs)
    normed = _norm(layer.post_attention_layernorm, hidden)
    gated = mlp.act_fn(_linear(mlp.gate_proj, normed, packs)) * _linear(mlp.up_proj, normed, packs)
    return hidden + _linear(mlp.down_proj, gated, packs)


def _rotated(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """The Llama kind's rotary embedding (its `apply_rotary_pos_emb`: `x * cos + rotate_half(x) *
    sin`, element for element, so bitwise the same) on the query and key heads `(N, heads, D)`
    together, in half the operations; `cos`/`sin` `(N, D)`."""
    heads, half = query.shape[1], query.shape[2] // 2
    both = torch.cat((query, key), dim=1)
    both = both * cos[:, None] + torch.cat((-both[..., half:], both[..., :half]), dim=-1) * sin[:, None]
    return both[:, :heads], both[:, heads:]


def _linear(module, x: torch.Tensor, packs: Packs | None) -> torch.Tensor:
    """`module(x)` for an `nn.Linear` `(N, in)`, without the module call; through the packed
    weights when there are some and N is FEWEST_PACKED to PACKED_ROWS[-1], padded to the first
    of PACKED_ROWS that holds it (the weight still float32 on the CPU: the model may have moved
    since its packs were decided)."""
    rows, weight = x.shape[0], module.weight
    size = _PADDED_TO.get(rows)
    if packs is None or size is None or weight.dtype != torch.float32 or not weight.is_cpu:
        return F.linear(x, weight, module.bias)
    if rows < size:
        x = torch.cat([x, x.new_zeros((size - rows, x.shape[1]))])
    return torch.ops.mkl._mkl_linear(x, packs.of(module, size), weight, module.bias, size)[:rows]


# a step's tokens -> the rows of the packed copy it takes (padded up to them)
_PADDED_TO = {rows: min(n for n in PACKED_ROWS if n >= rows) for rows in range(FEWEST_PACKED, PACKED_ROWS[-1] + 1)}


class Packs:
    """MKL's packed copies of one model's projection weights, one per step size of PACKED_ROWS,
    each made at its first use and made again when its weight is no longer the one it was made
    from (replaced, or changed in place: its version moved), so a copy is never stale."""

    def __init__(self) -> None:
        # by (module, rows): the weight and its version the copy was made from, the copy
        self._held: dict[tuple[int, int], tuple[torch.Tensor, int, torch.Tensor]] = {}
        self._lock = threading.Lock()

    def of(self, module, rows: int) -> torch.Tensor:
        weight, key = module.weight, (id(module), rows)
        with self._lock:
            held = self._held.get(key)
            if held is None or held[0] is not weight or held[1] != weight._version:
                held = (weight, weight._version, torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), rows))
                self._held[key] = held
            return held[2]

    def __len__(self) -> int:
        return len(self._held)


_PACKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> Packs, or None: not for it
_SERVED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> serves(model)
_LOCK = threading.Lock()


def packs_of(model) -> Packs | None:
    """`model`'s packed weights (see PACKED_ROWS), or None where it gets none: not float32 on a
    CPU with MKL, or projections over PACK_LIMIT bytes. Decided once per model."""
    return _decided(_PACKS, model, lambda m: Packs() if _packable(m) else None)


def _decided(table: weakref.WeakKeyDictionary, model, decide):
    """`decide(model)`, worked out at the first call for `model` and kept in `table` (weakly: a
    model dropped takes its entry with it)."""
    with _LOCK:
        if model not in table:
            table[model] = decide(model)
        return table[model]


def _packable(model) -> bool:
    if not (torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")):
        return False
    weights = [m.weight for m in model.modules() if type(m) is torch.nn.Linear]
    fits = sum(w.numel() * w.element_size() for w in weights) <= PACK_LIMIT
    return fits and all(w.dtype == torch.float32 and w.device.type == "cpu" for w in weights)


def _norm(module, x: torch.Tensor) -> torch.Tensor:
    """`module(x)` for the Llama kind's RMSNorm (Llama's, Qwen2's and Qwen3's forward, operation
    for operation: the mean of squares in float32, the weight applied in the input's dtype)."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)
    return module.weight * x.to(dtype)
