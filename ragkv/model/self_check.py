"""The self-test that keeps a model family no one here has tried from answering silently wrong.

A short probe prompt goes the way every stored answer goes: the prefix's KV computed alone,
two chunks' KV computed after it (in one padded batch, as ingest computes them; one by one for
a model with recurrent layers, each with the state at its end), each rebuilt into a cache from
the stored layout, and a question prefilled over it. The logits at every question position are
compared with a full prefill of the same ids (every position: a recurrent layer's conv window
reaches only the first few tokens after a prefix), and so is every recurrent state the two end
with. A model whose cached path is not exact (KV or state the store does not hold, layers the
layout misreads) is refused in one line naming the model class and the difference.

It runs when a store first gets a profile (ingest records the result in the profile) and when
an engine opens a profile not yet checked on this machine (remembered in ragkv's cache folder),
so each runs once. The chunks are longer than any sliding window of the model (up to 1,024
tokens), so a window handled wrongly shows.
"""

from __future__ import annotations

import json
import platform
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ragkv.core.config import cache_dir
from ragkv.core.errors import ModelError
from ragkv.kv import cache as kv
from ragkv.kv.entry import Entry
from ragkv.model.forward import compute_chunks, compute_prefix

PROBE_TEXT = (
    "The archive keeps every report in the order it arrived. Each week a clerk reads the new ones, "
    "writes a short summary, and files the summary beside the report. Questions about an old case "
    "start from the summaries, then open the reports they name. "
)
MAX_PROBE_CHUNK = 1024
FLOAT32_TOLERANCE = 1e-5  # relative; exact paths measured here differ by ~1e-7 (Jamba's Mamba scan ~2e-6)


@dataclass(frozen=True)
class SelfCheck:
    """One run of the self-test: the largest logit difference, over the question's positions,
    between the cached path and a full prefill, relative to the largest logit, and the tolerance
    for the dtype."""

    model_class: str
    dtype: str
    difference: float
    tolerance: float
    num_tokens: int  # the longest probe prompt
    machine: str  # where it ran (`machine_key`)

    @property
    def passed(self) -> bool:
        return self.difference <= self.tolerance

    def to_string(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_string(cls, text: str) -> SelfCheck:
        return cls(**json.loads(text))

    def refuse(self) -> None:
        """ModelError, in one line, unless the check passed."""
        if not self.passed:
            raise ModelError(
                f"ragkv refuses {self.model_class} in {self.dtype}: its answer from stored KV differs from a full "
                f"prefill by {self.difference:.1e} (relative; tolerance {self.tolerance:.1e}), so its cache is not "
                "one ragkv can store exactly"
            )


def tolerance(dtype: str, num_layers: int) -> float:
    """How far an exact cached path may land from a full prefill, relative to the largest logit.
    float32: rounding only (~1e-7). bf16/fp16 round differently for other matmul shapes, a noise
    that grows like a random walk over the layers: 1.5 units of the last place times sqrt(L)
    (SmolLM2 measured ~4 units in bf16, tests/test_exactness.py)."""
    if dtype == "float32":
        return FLOAT32_TOLERANCE
    unit = 2.0**-8 if dtype == "bfloat16" else 2.0**-11
    return 1.5 * unit * num_layers**0.5


def machine_key(device: str) -> str:
    """What the result of a check depends on besides the model: the device, torch, transformers."""
    import transformers

    where = torch.cuda.get_device_name() if str(device).startswith("cuda") else platform.processor() or "cpu"
    return f"{platform.machine()} {where} torch {torch.__version__} transformers {transformers.__version__}"


def probe_ids(tokenizer, model) -> tuple[list[int], list[list[int]], list[int]]:
    """The probe: a prefix, two chunks of different lengths (the longer past the model's largest
    sliding window), and a question, as token ids."""
    text = tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"]
    windows = [w for w in kv.layout_of(model.config).windows if w]
    longest = min(max([48, *(w + 16 for w in windows)]), MAX_PROBE_CHUNK)

    def take(start: int, count: int) -> list[int]:
        repeated = text * (1 + (start + count) // len(text))
        return repeated[start : start + count]

    return take(0, 16), [take(16, longest), take(7, longest // 2 + 3)], take(3, 9)


@torch.inference_mode()
def run(model, tokenizer, dtype: str, pad_id: int, perturb: Callable[[Entry], Entry] | None = None):
    """Run the self-test on `model`; `perturb` (for tests) changes each chunk's entry as a broken
    store would hand it back. Returns a SelfCheck."""
    prefix, chunks, question = probe_ids(tokenizer, model)
    prefix_kv = compute_prefix(model, prefix)
    worst = 0.0
    for computed in compute_chunks(model, prefix_kv, chunks, batch_tokens=4 * MAX_PROBE_CHUNK, pad_id=pad_id):
        chunk_kv = computed.kv.to(model.device)
        if perturb is not None:
            chunk_kv = perturb(chunk_kv)
        cache = kv.to_cache([prefix_kv, chunk_kv], model.config)
        ids = torch.tensor([question], device=model.device)
        keep = len(question)
        cached = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=keep).logits[0].float()  # (Q, V)
        whole = torch.tensor([prefix + chunks[computed.index] + question], device=model.device)
        full_cache = kv.to_cache_empty(model.config)
        full = model(input_ids=whole, cache=full_cache, use_cache=True, logits_to_keep=keep).logits[0].float()
        worst = max(worst, _relative(cached, full), _state_difference(cache, full_cache))
    return SelfCheck(
        model_class=type(model).__name__,
        dtype=dtype,
        difference=worst,
        tolerance=tolerance(dtype, kv.layout_of(model.config).num_layers),
        num_tokens=len(prefix) + max(map(len, chunks)) + len(question),
        machine=machine_key(str(model.device)),
    )


def _relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest difference between `got` and `expected`, relative to the largest of `expected`."""
    got, expected = got.float(), expected.float()
    return ((got - expected).abs().max() / expected.abs().max().clamp_min(1e-12)).item()


def _state_difference(cached, full) -> float:
    """How far the recurrent states the cached path ends with are from a full prefill's, each
    relative to its own largest value (0 without recurrent layers). Checked beside the logits:
    in a small random model a recurrent state can sway the logits less than rounding does."""
    after, expected = kv.state_of(cached), kv.state_of(full)
    return max((_relative(after[name], expected[name]) for name in expected), default=0.0)


def check_loaded(lm) -> SelfCheck:
    """The self-test of a loaded model (ragkv.model.llm.LoadedModel); raises ModelError when it fails."""
    result = run(lm.model, lm.tokenizer, lm.facts.dtype, lm.pad_id)
    result.refuse()
    return result


def _record_path(profile_id: str) -> Path:
    return cache_dir() / "checks" / f"{profile_id}.json"


def check_once(lm, profile_id: str, recorded: str | None) -> SelfCheck:
    """The self-test of profile `profile_id` on this machine: the `recorded` one (the profile's,
    from its first ingest) or one remembered in ragkv's cache folder when either ran here, else
    run now and remembered. Raises ModelError when it fails."""
    here = machine_key(str(lm.model.device))
    path = _record_path(profile_id)
    for text in (recorded, path.read_text() if path.is_file() else None):
        if text:
            known = SelfCheck.from_string(text)
            if known.machine == here and known.dtype == lm.facts.dtype:
                known.refuse()
                return known
    result = run(lm.model, lm.tokenizer, lm.facts.dtype, lm.pad_id)
    result.refuse()
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    temporary.write_text(result.to_string())
    temporary.replace(path)  # whole or absent: a crash leaves no half-written record
    return result
