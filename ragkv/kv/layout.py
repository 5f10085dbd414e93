"""What one model's attention cache holds, per layer: the one description of the stored layout.

transformers' caches differ by family, and ragkv's promise (stored KV + question = a full
prefill) holds only where the store keeps everything the continuation needs:
- full-attention layers (Llama, Qwen, ...): every token's keys and values.
- sliding-window layers (Mistral, Gemma 2/3, gpt-oss, Cohere2: alone or mixed with full ones):
  transformers keeps the last `window - 1` tokens. ragkv's cache keeps every token in these
  layers too, and the sliding mask (built from absolute positions) limits what each query
  attends to, so attention runs over exactly the window a full prefill sees, across chunk
  borders. An entry has one shape for every layer (below); the store keeps of a sliding layer
  only the last `window - 1` tokens of each entry (`ragkv.kv.codec`'s windowed form), all that a
  continuation reads (`benchmarks/results/families.md` gives bytes per token).
- multi-head latent attention (DeepSeek-V2/V3, Kimi, GLM-4.7-Flash, ...): transformers caches the
  compressed latent and the shared rotary key, of different widths and one head. ragkv stores
  them as cached (the latent, as vLLM does): keys and values side by side along the last dim.
- recurrent state (Mamba, linear attention: Falcon-H1, Granite 4, Qwen3-Next, Nemotron-H,
  Jamba): the state at a prefix's end is not KV, and concatenating chunks has no exact
  state. Refused in one line at load, so ingest and open both stop.

The canonical entry of T tokens is one tensor:
- `(L, 2, H, T, D)` when keys and values have the same width D (layers, key/value, heads,
  tokens, head dim);
- `(L, 1, H, T, Dk + Dv)` when they differ ("packed": keys in the first Dk of the last dim).
Entries that follow each other concatenate along dim 3 (tokens) in both.
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass

import torch

from ragkv.core.errors import ModelError

TOKEN_DIM = 3
_ATTENTION_LAYERS = ("DynamicLayer", "DynamicSlidingWindowLayer")  # transformers' cache layers ragkv can hold


@dataclass(frozen=True)
class KVLayout:
    """The stored layout of one model's KV (read off the model: `describe`)."""

    num_heads: int  # KV heads (1 for a latent)
    key_dim: int
    value_dim: int
    windows: tuple[int | None, ...]  # per layer: the sliding window, None for full attention

    @property
    def num_layers(self) -> int:
        return len(self.windows)

    @property
    def is_packed(self) -> bool:
        """Keys and values of different widths, side by side along the last dim."""
        return self.key_dim != self.value_dim

    @property
    def is_plain(self) -> bool:
        """Every layer full attention, keys and values of one width (what the approximate modes
        and the vLLM connector handle)."""
        return not self.is_packed and all(window is None for window in self.windows)

    @property
    def name(self) -> str:
        """The layout as shard headers and `ragkv stats` name it."""
        return "L1HT(K+V)" if self.is_packed else "L2HTD"

    def shape(self, num_tokens: int) -> tuple[int, ...]:
        """The canonical shape of an entry of `num_tokens` tokens."""
        if self.is_packed:
            return (self.num_layers, 1, self.num_heads, num_tokens, self.key_dim + self.value_dim)
        return (self.num_layers, 2, self.num_heads, num_tokens, self.key_dim)

    def bytes_per_token(self, itemsize: int) -> int:
        return self.num_layers * self.num_heads * (self.key_dim + self.value_dim) * itemsize

    def split(self, layer_kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer of a canonical entry, `(2, H, T, D)` or `(1, H, T, Dk + Dv)`, as views of
        its keys `(H, T, Dk)` and values `(H, T, Dv)`."""
        if self.is_packed:
            return layer_kv[0, ..., : self.key_dim], layer_kv[0, ..., self.key_dim :]
        return layer_kv[0], layer_kv[1]

    @property
    def key(self) -> str:
        """What a profile id hashes of the layout: "" for the plain one (so stores of plain models
        keep their ids), else the whole description."""
        return "" if self.is_plain else self.to_string()

    def to_string(self) -> str:
        return json.dumps(
            {"heads": self.num_heads, "key_dim": self.key_dim, "value_dim": self.value_dim, "windows": self.windows},
            separators=(",", ":"),
        )

    @classmethod
    def from_string(cls, text: str) -> KVLayout:
        fields = json.loads(text)
        return cls(fields["heads"], fields["key_dim"], fields["value_dim"], tuple(fields["windows"]))


def join(keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """Per-layer keys `(H, T, Dk)` and values `(H, T, Dv)` as a new canonical tensor: `(L, 2, H,
    T, D)`, or `(L, 1, H, T, Dk + Dv)` when the widths differ (the widths alone say which)."""
    if keys[0].shape[-1] != values[0].shape[-1]:
        return torch.stack([torch.cat(kv, dim=-1)[None] for kv in zip(keys, values, strict=True)])
    return torch.stack([torch.stack(kv) for kv in zip(keys, values, strict=True)])


_LAYOUTS: dict[int, KVLayout] = {}  # id(config) -> layout, registered by `describe`


def describe(model) -> KVLayout:
    """Read the layout off `model` (a 2-token forward into transformers' own cache), and register
    it for `layout_of(model.config)`. Raises ModelError, in one line naming the model class,
    where the cache holds anything but attention keys and values (recurrent state)."""
    from transformers import DynamicCache

    config = model.config
    cache = DynamicCache(config=config)
    refuse_recurrent(cache, type(model).__name__)
    try:
        with torch.inference_mode():
            model(input_ids=torch.zeros((1, 2), dtype=torch.long, device=model.device), cache=cache, use_cache=True)
    except (RuntimeError, ValueError, IndexError) as exc:  # the model's own code fails on its config
        raise ModelError(f"{type(model).__name__} fails a 2-token forward: {exc}".splitlines()[0]) from exc
    refuse_recurrent(cache, type(model).__name__)
    shapes = {(layer.keys.shape[1], layer.keys.shape[3], layer.values.shape[3]) for layer in cache.layers}
    if len(shapes) != 1:
        raise ModelError(
            f"ragkv cannot store {type(model).__name__}'s KV: its layers cache keys and values of different shapes "
            f"{sorted(shapes)}; use another model"
        )
    heads, key_dim, value_dim = shapes.pop()
    windows = tuple(getattr(layer, "sliding_window", None) for layer in cache.layers)
    layout = KVLayout(heads, key_dim, value_dim, windows)
    _register(config, layout)
    return layout


def model_class(config) -> str:
    """The model class a config names (its own class name when it names none)."""
    return (getattr(config, "architectures", None) or [type(config).__name__])[0]


def refuse_recurrent(cache, model_class: str) -> None:
    """ModelError, in one line naming `model_class`, when a transformers `cache` keeps anything
    but attention keys and values (recurrent state)."""
    for layer in cache.layers:
        if type(layer).__name__ not in _ATTENTION_LAYERS:
            raise ModelError(
                f"ragkv cannot serve {model_class} exactly: its cache keeps {type(layer).__name__} "
                "(recurrent state beside or instead of attention KV), which a stored prefix does not hold; "
                "use a model with attention layers only"
            )


def _register(config, layout: KVLayout) -> None:
    key = id(config)
    if key not in _LAYOUTS:
        weakref.finalize(config, _LAYOUTS.pop, key, None)
    _LAYOUTS[key] = layout


def layout_of(config) -> KVLayout:
    """The layout `describe` read for this model config; for a config never described (a model
    built by hand), the plain layout its config states (full or sliding layers of one width)."""
    layout = _LAYOUTS.get(id(config))
    if layout is not None:
        return layout
    from transformers import DynamicCache

    text = config.get_text_config()
    if getattr(text, "kv_lora_rank", None):
        raise ModelError("a model with latent attention needs ragkv.kv.layout.describe(model) before its KV is used")
    cache = DynamicCache(config=config)
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    windows = tuple(getattr(layer, "sliding_window", None) for layer in cache.layers)
    layout = KVLayout(heads, head_dim, head_dim, windows)
    _register(config, layout)
    return layout


def not_plain(config) -> str | None:
    """Why a model (by its config alone, no weights) is not of the plain layout (every layer full
    attention, keys and values of one width), in words; None when it is."""
    from transformers import DynamicCache

    text = config.get_text_config()
    name = model_class(config)
    if getattr(text, "kv_lora_rank", None):
        return f"{name} caches a latent (multi-head latent attention)"
    kinds = {type(layer).__name__ for layer in DynamicCache(config=config).layers}
    if kinds - {"DynamicLayer"} == {"DynamicSlidingWindowLayer"}:
        return f"{name} has sliding-window layers"
    if kinds - {"DynamicLayer"}:
        return f"{name} keeps recurrent state ({', '.join(sorted(kinds - {'DynamicLayer'}))})"
    return None


def refuse_unless_plain(folder) -> None:
    """ModelError, in one line, for a model that the vLLM connector cannot move exactly. The
    connector moves each layer's KV of every token through vLLM's paged blocks; vLLM keeps only
    the window of a sliding layer, and a latent or a recurrent state in blocks of other shapes.
    ragkv's own engine serves those models."""
    from transformers import AutoConfig

    problem = not_plain(AutoConfig.from_pretrained(folder))
    if problem is not None:
        raise ModelError(
            f"the ragkv vLLM connector moves KV of full-attention layers only, and {problem}: "
            "use ragkv's own engine (ragkv ingest/ask/serve without --engine vllm)"
        )
