"""How KV is stored: as computed (lossless, the default), or compressed (approximate, opt-in).

An encoded entry (`ragkv.kv.entry.Entry`) is a dict of tensors: "" holds the canonical
`(L, 2, H, T, D)` data of the layout's first layer group in the storage dtype, plus what its
decoding needs; a further group n is stored the same way under names prefixed "gn" ("g1",
"g1.kscale", ...); each recurrent layer's state under "state." + its name
(`ragkv.kv.layout.StateSpec.name`), always as computed (lossless, in the dtype the model keeps
it). A plain model's entry is "" alone, as ragkv has always stored it. All integer forms follow KIVI (Liu et al., 2024):
keys are quantised per channel (key outliers live in fixed channels), values per token.
- int8: symmetric, absmax / 127; "kscale" `(L, H, 1, D)` and "vscale" `(L, H, T, 1)`.
- int4, int2: asymmetric (a minimum and a step per group, float16), codes packed 2 or 4 to a
  byte along D: "" is uint8 `(L, 2, H, T, D * bits / 8)`; "kmin"/"kstep" `(L, H, 1, D)` per key
  channel over the entry's tokens; "vmin"/"vstep" `(L, H, T, 1)` per value token.
  Bytes against float32: int4 0.13x, int2 0.07x (the bundled model: 3 KV heads of 64).
- windowed (lossless for every exact use; as computed or float16/bfloat16): a model with
  sliding-window layers needs, to continue past an entry, only each sliding layer's last
  `window - 1` tokens of it; no later query attends to the ones before. An entry longer than
  that stores "" the full-attention layers `(L_full, 2, H, T, D)`, "slid" the sliding layers'
  last `window - 1` tokens `(L_sliding, 2, H, window - 1, D)`, and "windowed" (int64) T and the
  sliding layers' indices. Decoding puts zeros where the dropped tokens were, which the sliding
  mask hides (gpt-oss, window 128, at 512-token chunks: 0.62x the bytes).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from ragkv.core.errors import InputError, StoreFormatError
from ragkv.kv.entry import Entry
from ragkv.kv.layout import KVLayout

STATE_PREFIX = "state."  # an entry's recurrent states' stored names begin with it
_FLOAT = {"bfloat16": torch.bfloat16, "float16": torch.float16}
_PACKED = {"int4": 4, "int2": 2}  # bits per code


def shard_metadata(profile_id: str, model_name: str, dtype: str, layout: str = "L2HTD") -> dict[str, str]:
    """What a KV shard's header says about its entries (`layout`: `KVLayout.name`)."""
    return {"layout": layout, "profile_id": profile_id, "model": model_name, "dtype": dtype}


def kv_quant(kv_dtype: str, compute_dtype: str) -> str:
    """The profile's kv_quant (part of every cache key): "none" when stored as computed."""
    return "none" if kv_dtype in ("auto", compute_dtype) else kv_dtype


def encode(entry: Entry, quant: str, layout: KVLayout | None = None) -> dict[str, torch.Tensor]:
    """The tensors to store for `entry`: each layer group encoded as `quant` says (given the
    model's `layout`, a sliding layer keeps only what a continuation reads: "windowed" above),
    the state as computed."""
    parts: dict[str, torch.Tensor] = {}
    for index, group_kv in enumerate(entry.groups):
        windows = layout.groups[index].windows if layout is not None else ()
        for name, tensor in _encode_group(group_kv, quant, windows).items():
            parts[_group_part(index, name)] = tensor
    for name, tensor in (entry.state or {}).items():
        parts[STATE_PREFIX + name] = tensor
    return parts


def _group_part(index: int, name: str) -> str:
    """The stored name of group `index`'s part `name`: group 0's as ever, others prefixed."""
    if index == 0:
        return name
    return f"g{index}.{name}" if name else f"g{index}"


def _encode_group(kv: torch.Tensor, quant: str, windows: Sequence[int | None]) -> dict[str, torch.Tensor]:
    """kv: canonical `(L, 2, H, T, D)` (or a latent's `(L, 1, H, T, Dk + Dv)`). `windows`: the
    group's per-layer sliding windows (None: full attention); given, a sliding layer keeps only
    what a continuation reads (see "windowed" above)."""
    if quant == "none" or quant in _FLOAT:
        data = kv.to(_FLOAT[quant]) if quant in _FLOAT else kv
        return _windowed(data, windows) or {"": data}
    if kv.shape[1] != 2:
        raise InputError(
            f"--kv-dtype {quant} quantises keys per channel and values per token; this model's KV is a latent "
            "(keys and values side by side): use --kv-dtype auto, float16 or bfloat16"
        )
    if quant in _PACKED:
        return _encode_packed(kv.float(), _PACKED[quant])
    if quant != "int8":
        raise StoreFormatError(f"unknown KV quantisation {quant!r}: the store was written by a newer ragkv")
    data = kv.float()
    keys, values = data[:, 0], data[:, 1]  # each (L, H, T, D)
    key_scale = keys.abs().amax(dim=2, keepdim=True).clamp_min(1e-8) / 127  # (L, H, 1, D): per channel
    value_scale = values.abs().amax(dim=3, keepdim=True).clamp_min(1e-8) / 127  # (L, H, T, 1): per token
    quantised = torch.stack([(keys / key_scale).round(), (values / value_scale).round()], dim=1)  # (L, 2, H, T, D)
    return {"": quantised.clamp(-127, 127).to(torch.int8), "kscale": key_scale, "vscale": value_scale}


def decode(parts: dict[str, torch.Tensor], dtype: torch.dtype) -> Entry:
    """The entry of stored `parts`: its KV in the compute `dtype`, its state as stored."""
    groups: dict[int, dict[str, torch.Tensor]] = {}
    state = {}
    for name, tensor in parts.items():
        if name.startswith(STATE_PREFIX):
            state[name[len(STATE_PREFIX) :]] = tensor
            continue
        head, _, rest = name.partition(".")
        if head.startswith("g") and head[1:].isdigit():
            groups.setdefault(int(head[1:]), {})[rest] = tensor
        else:
            groups.setdefault(0, {})[name] = tensor
    decoded = tuple(_decode_group(groups[index], dtype) for index in sorted(groups))
    return Entry(decoded, state or None)


def _decode_group(parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The canonical `(L, 2, H, T, D)` KV of one group in the compute `dtype`, from stored parts."""
    if "windowed" in parts:
        return _unwindowed(parts, dtype)
    data = parts[""]
    if "vmin" in parts:
        return _decode_packed(parts).to(dtype)
    if data.dtype != torch.int8:
        return data if data.dtype == dtype else data.to(dtype)
    keys = data[:, 0].float() * parts["kscale"]  # (L, H, T, D)
    values = data[:, 1].float() * parts["vscale"]
    return torch.stack([keys, values], dim=1).to(dtype)


def read(shards, entry, dtype: torch.dtype, device: str | torch.device = "cpu", out=None) -> Entry:
    """The stored entry of catalog `entry` (its shard, tensor and checksum), its KV in `dtype`,
    on `device`: read from `shards` (a ragkv.store.kv.shards.ShardReader, into buffer `out` when
    given: the entry then views it), verified, and decoded. From pinned host memory the copy to a GPU is asynchronous;
    work queued after it on the same stream sees the data."""
    parts = shards.read_parts(entry.shard, entry.tensor, entry.checksum, out=out)
    return decode({name: t.to(device, non_blocking=True) for name, t in parts.items()}, dtype)


class StoredKV:
    """A stored entry of one layer group and no state, `(L, 2, H, T, D)`, not read yet: `fill`
    reads it straight into the cache that will hold it (`ragkv.kv.cache.to_cache` takes it as a
    part), so the bytes are copied once, from the file into the cache. Reading into a buffer and
    copying that into the cache cost a second copy: 7 ms of 0.207 s to the first token at 4k
    tokens of float32 KV (190 MB, benchmarks/results/cached_path.md). Only for entries stored as
    one part in the compute dtype, on the CPU (`deferred` says when); the bytes are checked
    against the checksum as they are read."""

    def __init__(self, shards, entry, dtype: torch.dtype, shape: tuple[int, ...]):
        self.shards, self.row = shards, entry  # the catalog's row of the entry
        self.dtype, self.shape, self.device = dtype, torch.Size(shape), torch.device("cpu")
        self.num_tokens = self.shape[3]
        self.state = None  # an entry with a state has parts beside "": never deferred
        self.nbytes = self.shape.numel() * dtype.itemsize
        self.keep: Callable[[Entry], None] | None = None  # given a copy once read (a RAM tier)
        self.read_ms = 0.0  # how long `fill` took

    def fill(self, layers: Sequence[tuple[torch.Tensor, torch.Tensor]], start: int) -> None:
        """Read into tokens `[start, start + T)` of every layer's `(B, H, capacity, D)` keys
        and values buffers (batch row 0, then copied to the other rows)."""
        began = time.perf_counter()
        _, _, _, tokens, _ = self.shape
        stop = start + tokens
        targets = [target for layer in layers for target in self.targets(layer, start)]
        self.shards.read_into(self.row.shard, self.row.tensor, self.row.checksum, targets)
        for keys, values in layers:
            keys[1:, :, start:stop] = keys[:1, :, start:stop]
            values[1:, :, start:stop] = values[:1, :, start:stop]
        self.read_ms = (time.perf_counter() - began) * 1000.0
        if self.keep is not None:
            kept = torch.empty(self.shape, dtype=self.dtype)
            for layer, (keys, values) in enumerate(layers):
                kept[layer, 0], kept[layer, 1] = keys[0, :, start:stop], values[0, :, start:stop]
            self.keep(Entry.of(kept))

    def targets(self, layer: tuple[torch.Tensor, torch.Tensor], start: int) -> list[memoryview]:
        """Where one layer's stored bytes go, in their order: the keys' then the values' heads,
        tokens `[start, start + T)` of batch row 0 of the `(B, H, capacity, D)` buffers."""
        _, _, heads, tokens, _ = self.shape
        return [
            memoryview(buffer[0, head, start : start + tokens].view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]
            for buffer in layer  # each (T, D) block is contiguous, as stored
            for head in range(heads)
        ]

    def entry(self) -> Entry:
        """The entry read into new memory, for a use that needs it whole."""
        return read(self.shards, self.row, self.dtype)


def deferred(shards, entry, dtype: torch.dtype, device: str | torch.device) -> StoredKV | None:
    """`entry`'s KV to be read straight into a cache (see StoredKV), when it is stored as one part
    in `dtype` and the cache is on the CPU; else None (read it with `read`)."""
    if torch.device(device).type != "cpu":
        return None
    parts = shards.layout(entry.shard, entry.tensor)
    if set(parts) != {""} or parts[""][0] != dtype or len(parts[""][1]) != 5 or parts[""][1][1] != 2:
        return None  # encoded, another dtype, or a latent (keys and values side by side: read whole)
    return StoredKV(shards, entry, dtype, parts[""][1])


def _encode_packed(data: torch.Tensor, bits: int) -> dict[str, torch.Tensor]:
    """data: float `(L, 2, H, T, D)`, D a multiple of 8 / bits."""
    if data.shape[-1] % (8 // bits):
        raise InputError(
            f"--kv-dtype int{bits} packs {8 // bits} values to a byte; this model's head dimension "
            f"{data.shape[-1]} does not divide by {8 // bits}: use int8"
        )
    levels = 2**bits - 1
    keys, values = data[:, 0], data[:, 1]  # each (L, H, T, D)
    key_min, key_step = _range(keys, dim=2, levels=levels)  # (L, H, 1, D): per channel
    value_min, value_step = _range(values, dim=3, levels=levels)  # (L, H, T, 1): per token
    codes = torch.stack([((keys - key_min) / key_step).round(), ((values - value_min) / value_step).round()], dim=1)
    codes = codes.clamp(0, levels).to(torch.uint8)  # (L, 2, H, T, D)
    per_byte = 8 // bits
    grouped = codes.reshape(*codes.shape[:-1], -1, per_byte)  # (L, 2, H, T, D / per_byte, per_byte)
    shifts = torch.arange(per_byte, dtype=torch.uint8) * bits  # code i sits at bits [i*bits, (i+1)*bits)
    packed = (grouped << shifts).sum(dim=-1, dtype=torch.uint8)  # disjoint bits: the sum is an OR
    return {
        "": packed,
        "kmin": key_min.half(),
        "kstep": key_step.half(),
        "vmin": value_min.half(),
        "vstep": value_step.half(),
    }


def _range(x: torch.Tensor, dim: int, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Minimum and step (float16-rounded, so that encoding uses what decoding will) along `dim`."""
    low = x.amin(dim=dim, keepdim=True).half().float()
    step = ((x.amax(dim=dim, keepdim=True) - low) / levels).clamp_min(1e-6).half().float()
    return low, step


def _decode_packed(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    packed, dim = parts[""], parts["kmin"].shape[-1]
    bits = 8 * packed.shape[-1] // dim
    shifts = torch.arange(8 // bits, dtype=torch.uint8) * bits
    codes = ((packed[..., None] >> shifts) & (2**bits - 1)).reshape(*packed.shape[:-1], dim).float()  # (L, 2, H, T, D)
    keys = codes[:, 0] * parts["kstep"].float() + parts["kmin"].float()
    values = codes[:, 1] * parts["vstep"].float() + parts["vmin"].float()
    return torch.stack([keys, values], dim=1)  # (L, 2, H, T, D) float32


def _windowed(data: torch.Tensor, windows: Sequence[int | None]) -> dict[str, torch.Tensor] | None:
    """The "windowed" form of `data` (canonical, T tokens), or None when no sliding layer holds
    more than it needs (no windows, or T within the window)."""
    sliding = [layer for layer, window in enumerate(windows) if window]
    if not sliding:
        return None
    tail = max(windows[layer] or 0 for layer in sliding) - 1  # what the widest window reads back
    tokens = data.shape[3]
    if tokens <= tail:
        return None
    full = [layer for layer, window in enumerate(windows) if not window]
    return {
        "": data[full].contiguous(),  # (L_full, 2, H, T, D); L_full may be 0 (every layer slides)
        "slid": data[sliding, :, :, tokens - tail :].contiguous(),  # (L_sliding, 2, H, window - 1, D)
        "windowed": torch.tensor([tokens, *sliding], dtype=torch.int64),
    }


def _unwindowed(parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The canonical tensor of a "windowed" entry: its sliding layers' dropped tokens zero."""
    tokens, *sliding = parts["windowed"].tolist()
    full, slid = parts[""], parts["slid"]
    _, pair, heads, tail, dim = slid.shape
    out = slid.new_zeros((len(full) + len(sliding), pair, heads, tokens, dim), dtype=dtype)
    kept = sorted(set(range(len(out))) - set(sliding))
    out[kept] = full.to(dtype)
    out[sliding, :, :, tokens - tail :] = slid.to(dtype)
    return out
