"""What one model's cache holds, per layer: the one description of the stored layout.

transformers' caches differ by family, and ragkv's promise (stored KV + question = a full
prefill) holds only where the store keeps everything the continuation needs:
- full-attention layers (Llama, Qwen, ...): every token's keys and values.
- sliding-window layers (Mistral, Gemma 2/3/4, gpt-oss, Cohere2: alone or mixed with full ones):
  transformers keeps the last `window - 1` tokens. ragkv's cache keeps every token in these
  layers too, and the sliding mask (built from absolute positions) limits what each query
  attends to, so attention runs over exactly the window a full prefill sees, across chunk
  borders. The store keeps of a sliding layer only the last `window - 1` tokens of each entry
  (`ragkv.kv.codec`'s windowed form), all that a continuation reads.
- multi-head latent attention (DeepSeek-V2/V3, Kimi, GLM-4.7-Flash, ...): transformers caches the
  compressed latent and the shared rotary key, of different widths and one head. ragkv stores
  them as cached (the latent, as vLLM does): keys and values side by side along the last dim.
- layers whose keys and values differ in shape from other layers' (Gemma 4: sliding layers of
  one head size, global ones of another): each shape is a group of its own (`KVGroup`), stored
  as it is, with no padding.
- layers that cache nothing (an MLP or MoE block of Nemotron-H, a layer that reads another's KV
  in Gemma 4): nothing stored.
- recurrent layers (Gated DeltaNet: Qwen3.5, Qwen3-Next; Mamba/Mamba2: Nemotron-H, Granite 4,
  Jamba, Falcon-H1 beside its attention; short convolutions: LFM2): each keeps, instead of (or
  beside) per-token KV, a state of fixed size: a convolution window and, for most, a recurrent
  matrix (`StateSpec`). An entry stores the state after its last token; it lets a continuation
  go on exactly from there, but only from there: states do not concatenate as KV does
  (`ragkv.kv.entry`).

An entry's KV is one canonical tensor per group, of T tokens:
- `(L_g, 2, H, T, D)` when keys and values have the same width D (layers of the group,
  key/value, heads, tokens, head dim);
- `(L_g, 1, H, T, Dk + Dv)` when they differ ("packed": keys in the first Dk of the last dim).
Entries that follow each other concatenate along dim 3 (tokens) in both.
"""

from __future__ import annotations

import json
import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ragkv.core.errors import ModelError

TOKEN_DIM = 3
# transformers' cache layers, by what they hold: keys and values, a recurrent state, both, or nothing
ATTENTION_LAYERS = ("DynamicLayer", "DynamicSlidingWindowLayer")
_STATE_LAYERS = ("LinearAttentionLayer",)
_BOTH_LAYERS = ("LinearAttentionAndFullAttentionLayer", "LinearAttentionAndSlidingWindowAttentionLayer")
STATE_LAYER_KINDS = _STATE_LAYERS + _BOTH_LAYERS  # the layers that keep a recurrent state
_EMPTY_LAYERS = ("DummyLayer",)
# Families whose recurrent layers transformers cannot continue from a cached state in a forward of
# several tokens (5.25: the Mamba v1 scan starts from zeros whatever the cache holds; its own code
# says so), so a question after a stored prefix would not see the prefix's state.
_NO_CONTINUATION = {"jamba": "Jamba", "mamba": "Mamba", "falcon_mamba": "FalconMamba"}


@dataclass(frozen=True)
class KVGroup:
    """Layers whose keys and values have one shape, in model order: one tensor of an entry."""

    layers: tuple[int, ...]  # the model's layer indices
    num_heads: int  # KV heads (1 for a latent)
    key_dim: int
    value_dim: int
    windows: tuple[int | None, ...]  # per layer of the group: the sliding window, None for full attention

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def is_packed(self) -> bool:
        """Keys and values of different widths, side by side along the last dim."""
        return self.key_dim != self.value_dim

    def shape(self, num_tokens: int) -> tuple[int, ...]:
        """The canonical shape of the group's tensor in an entry of `num_tokens` tokens."""
        if self.is_packed:
            return (self.num_layers, 1, self.num_heads, num_tokens, self.key_dim + self.value_dim)
        return (self.num_layers, 2, self.num_heads, num_tokens, self.key_dim)

    def bytes_per_token(self, itemsize: int) -> int:
        return self.num_layers * self.num_heads * (self.key_dim + self.value_dim) * itemsize

    def split(self, layer_kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer of the group's tensor, `(2, H, T, D)` or `(1, H, T, Dk + Dv)`, as views of
        its keys `(H, T, Dk)` and values `(H, T, Dv)`."""
        if self.is_packed:
            return layer_kv[0, ..., : self.key_dim], layer_kv[0, ..., self.key_dim :]
        return layer_kv[0], layer_kv[1]

    def to_dict(self) -> dict:
        return {
            "layers": list(self.layers),
            "heads": self.num_heads,
            "key_dim": self.key_dim,
            "value_dim": self.value_dim,
            "windows": list(self.windows),
        }


@dataclass(frozen=True)
class StateSpec:
    """One state a recurrent layer keeps, of a fixed size: its conv window or its recurrent
    matrix (transformers' `conv_states[index]` / `recurrent_states[index]`), per sequence."""

    layer: int
    kind: str  # "conv" or "recurrent"
    index: int  # transformers' state_idx (a layer may keep several)
    shape: tuple[int, ...]  # without the batch dim
    dtype: str  # as the model keeps it (often float32 beside bf16 weights)

    @property
    def name(self) -> str:
        """Its name in an entry (`ragkv.kv.entry.Entry.state`) and, prefixed, in a shard."""
        return f"{self.layer}.{self.kind}.{self.index}"

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.torch_dtype.itemsize

    def to_dict(self) -> dict:
        shape = list(self.shape)
        return {"layer": self.layer, "kind": self.kind, "index": self.index, "shape": shape, "dtype": self.dtype}


@dataclass(frozen=True)
class KVLayout:
    """The stored layout of one model's cache (read off the model: `describe`): its layers that
    cache keys and values, in groups of one shape, and the states its recurrent layers keep."""

    groups: tuple[KVGroup, ...]
    num_layers: int  # the model's layers (some may hold no KV)
    states: tuple[StateSpec, ...] = ()

    @classmethod
    def uniform(cls, heads: int, key_dim: int, value_dim: int, windows: Sequence[int | None]) -> KVLayout:
        """Every layer caching keys and values of one shape (`windows`: one per layer)."""
        layers = tuple(range(len(windows)))
        return cls((KVGroup(layers, heads, key_dim, value_dim, tuple(windows)),), len(windows))

    @property
    def windows(self) -> tuple[int | None, ...]:
        """The sliding window of every layer that caches keys and values, in model order."""
        return tuple(window for _, window in sorted(self._windows_by_layer().items()))

    def _windows_by_layer(self) -> dict[int, int | None]:
        return {
            layer: window for group in self.groups for layer, window in zip(group.layers, group.windows, strict=True)
        }

    @property
    def has_state(self) -> bool:
        """Whether some layer keeps a recurrent state (an entry's is valid only at its end)."""
        return bool(self.states)

    @property
    def is_plain(self) -> bool:
        """Every layer full attention, keys and values of one width, no state (what the
        approximate modes and the vLLM connector handle)."""
        if len(self.groups) != 1 or self.states:
            return False
        group = self.groups[0]
        return not group.is_packed and group.num_layers == self.num_layers and all(w is None for w in group.windows)

    @property
    def name(self) -> str:
        """The layout as shard headers and `ragkv stats` name it."""
        base = "+".join("L1HT(K+V)" if g.is_packed else "L2HTD" for g in self.groups) or "-"
        return f"{base}+state" if self.states else base

    def bytes_per_token(self, itemsize: int) -> int:
        """KV bytes one token adds to an entry (every layer every token, at `itemsize`)."""
        return sum(group.bytes_per_token(itemsize) for group in self.groups)

    @property
    def state_bytes(self) -> int:
        """Bytes of the state an entry ends with (0 without recurrent layers)."""
        return sum(spec.nbytes for spec in self.states)

    def describe_layers(self) -> list[str]:
        """Each model layer in words: "full", "sliding 12", "state", "full+state", "none"."""
        kv = self._windows_by_layer()
        stateful = {spec.layer for spec in self.states}
        words = []
        for layer in range(self.num_layers):
            parts = []
            if layer in kv:
                parts.append("full" if kv[layer] is None else f"sliding {kv[layer]}")
            if layer in stateful:
                parts.append("state")
            words.append("+".join(parts) or "none")
        return words

    @property
    def key(self) -> str:
        """What a profile id hashes of the layout: "" for the plain one (so stores of plain models
        keep their ids), else the whole description."""
        return "" if self.is_plain else self.to_string()

    def to_string(self) -> str:
        """The layout as JSON: the form earlier ragkv wrote for one group over every layer and no
        state (so those profiles keep their ids), else every group and state."""
        if len(self.groups) == 1 and not self.states and self.groups[0].layers == tuple(range(self.num_layers)):
            group = self.groups[0]
            fields: dict = {
                "heads": group.num_heads,
                "key_dim": group.key_dim,
                "value_dim": group.value_dim,
                "windows": group.windows,
            }
        else:
            fields = {
                "layers": self.num_layers,
                "groups": [group.to_dict() for group in self.groups],
                "states": [spec.to_dict() for spec in self.states],
            }
        return json.dumps(fields, separators=(",", ":"))

    @classmethod
    def from_string(cls, text: str) -> KVLayout:
        fields = json.loads(text)
        if "groups" not in fields:
            return cls.uniform(fields["heads"], fields["key_dim"], fields["value_dim"], fields["windows"])
        groups = tuple(
            KVGroup(tuple(g["layers"]), g["heads"], g["key_dim"], g["value_dim"], tuple(g["windows"]))
            for g in fields["groups"]
        )
        states = tuple(
            StateSpec(s["layer"], s["kind"], s["index"], tuple(s["shape"]), s["dtype"]) for s in fields["states"]
        )
        return cls(groups, fields["layers"], states)


def join(keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """Per-layer keys `(H, T, Dk)` and values `(H, T, Dv)` of one group as a new canonical
    tensor: `(L, 2, H, T, D)`, or `(L, 1, H, T, Dk + Dv)` when the widths differ (the widths
    alone say which)."""
    if keys[0].shape[-1] != values[0].shape[-1]:
        return torch.stack([torch.cat(kv, dim=-1)[None] for kv in zip(keys, values, strict=True)])
    return torch.stack([torch.stack(kv) for kv in zip(keys, values, strict=True)])


_LAYOUTS: dict[int, KVLayout] = {}  # id(config) -> layout, registered by `describe`


def describe(model) -> KVLayout:
    """Read the layout off `model` (a 2-token forward into transformers' own cache), and register
    it for `layout_of(model.config)`. Raises ModelError, in one line naming the model class,
    where the cache holds anything ragkv cannot store."""
    from transformers import DynamicCache

    config = model.config
    cache = DynamicCache(config=config)
    name = type(model).__name__
    refuse_unknown(cache, name)
    model_type = getattr(config.get_text_config(), "model_type", "")
    if model_type in _NO_CONTINUATION:
        raise ModelError(
            f"ragkv cannot serve {name} exactly: transformers' {_NO_CONTINUATION[model_type]} layers start a forward "
            "of several tokens from a zero state, not from a stored one, so a question cannot continue a stored "
            "prefix; use a model with Mamba2, linear-attention or attention layers"
        )
    try:
        with torch.inference_mode():
            model(input_ids=torch.zeros((1, 2), dtype=torch.long, device=model.device), cache=cache, use_cache=True)
    except (RuntimeError, ValueError, IndexError) as exc:  # the model's own code fails on its config
        raise ModelError(f"{name} fails a 2-token forward: {exc}".splitlines()[0]) from exc
    refuse_unknown(cache, name)
    layout = read_layout(cache, name)
    _register(config, layout)
    return layout


def read_layout(cache, name: str) -> KVLayout:
    """The layout of a transformers `cache` a forward has filled."""
    by_shape: dict[tuple[int, int, int], list[tuple[int, int | None]]] = {}
    states = []
    for index, layer in enumerate(cache.layers):
        kind = type(layer).__name__
        if kind in ATTENTION_LAYERS + _BOTH_LAYERS:
            shape = (layer.keys.shape[1], layer.keys.shape[3], layer.values.shape[3])
            by_shape.setdefault(shape, []).append((index, getattr(layer, "sliding_window", None)))
        if kind in _STATE_LAYERS + _BOTH_LAYERS:
            states += _state_specs(layer, index)
    groups = tuple(
        KVGroup(tuple(i for i, _ in members), heads, key_dim, value_dim, tuple(w for _, w in members))
        for (heads, key_dim, value_dim), members in sorted(by_shape.items(), key=lambda item: item[1][0][0])
    )
    if not groups and not states:
        raise ModelError(f"ragkv cannot store {name}'s cache: it holds neither keys and values nor a state")
    return KVLayout(groups, len(cache.layers), tuple(states))


def _state_specs(layer, index: int) -> list[StateSpec]:
    """The states a transformers linear-attention cache layer holds after a forward."""
    specs = []
    for state_index in range(layer.number_of_states):
        for kind, held, initialised in (
            ("conv", layer.conv_states, layer.is_conv_states_initialized),
            ("recurrent", layer.recurrent_states, layer.is_recurrent_states_initialized),
        ):
            if initialised[state_index]:
                tensor = held[state_index]
                dtype = str(tensor.dtype).removeprefix("torch.")
                specs.append(StateSpec(index, kind, state_index, tuple(tensor.shape[1:]), dtype))
    return specs


def model_class(config) -> str:
    """The model class a config names (its own class name when it names none)."""
    return (getattr(config, "architectures", None) or [type(config).__name__])[0]


def refuse_unknown(cache, model_class: str) -> None:
    """ModelError, in one line naming `model_class`, when a transformers `cache` keeps anything
    but attention keys and values, recurrent state, or nothing (an indexer's keys, say)."""
    known = ATTENTION_LAYERS + _STATE_LAYERS + _BOTH_LAYERS + _EMPTY_LAYERS
    for layer in cache.layers:
        if type(layer).__name__ not in known:
            raise ModelError(
                f"ragkv cannot serve {model_class} exactly: its cache keeps {type(layer).__name__}, which ragkv "
                "does not know how to store; use a model with attention or recurrent layers"
            )


def _register(config, layout: KVLayout) -> None:
    key = id(config)
    if key not in _LAYOUTS:
        weakref.finalize(config, _LAYOUTS.pop, key, None)
    _LAYOUTS[key] = layout


def layout_of(config) -> KVLayout:
    """The layout `describe` read for this model config; for a config never described (a model
    built by hand), the layout its config states when every layer caches keys and values of one
    width (full or sliding). Raises ModelError for other configs: describe the model first."""
    layout = _LAYOUTS.get(id(config))
    if layout is not None:
        return layout
    from transformers import DynamicCache

    text = config.get_text_config()
    cache = DynamicCache(config=config)
    kinds = {type(layer).__name__ for layer in cache.layers}
    if getattr(text, "kv_lora_rank", None) or not kinds <= set(ATTENTION_LAYERS):
        raise ModelError(
            f"{model_class(config)}'s cache is not plain attention: call ragkv.kv.layout.describe(model) first"
        )
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    windows = tuple(getattr(layer, "sliding_window", None) for layer in cache.layers)
    layout = KVLayout.uniform(heads, head_dim, head_dim, windows)
    _register(config, layout)
    return layout
