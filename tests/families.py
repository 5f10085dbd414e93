"""Tiny random models of every model family ragkv is asked about, saved as model folders with
SmolLM2's tokenizer and chat template (as a user would point `--model` at them).

Each is hidden 64, 2 layers; sliding windows are WINDOW tokens, smaller than the tests' chunks,
so the window matters. `benchmarks/families.py` and `tests/test_families.py` build them here.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import torch

WINDOW = 12  # sliding window (tokens): shorter than a chunk and than the system prompt

TINY = dict(  # every tiny test model's shape (conftest's Llama and Qwen2 too), SmolLM2's vocabulary
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
    tie_word_embeddings=True,
)
COMMON = {**TINY, "head_dim": 16}  # stated: some families' defaults differ (Gemma's 256)
MIXED = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=WINDOW)
MOE = dict(num_local_experts=4, num_experts_per_tok=2)
# the recurrent layers' own sizes, small: as transformers' defaults they hold MBs of state
LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_n_groups=1)

# family -> (transformers model_type, config fields beside COMMON, what ragkv does with it)
FAMILIES: dict[str, tuple[str, dict, str]] = {
    "llama": ("llama", {}, "exact"),
    "qwen2": ("qwen2", {"rope_theta": 1e6}, "exact"),
    "qwen3": ("qwen3", {}, "exact"),
    "mistral (sliding)": ("mistral", {"sliding_window": WINDOW}, "exact"),
    "mixtral": ("mixtral", MOE, "exact"),
    "phi3": ("phi3", {}, "exact"),
    "olmo2": ("olmo2", {}, "exact"),
    "granite": ("granite", {}, "exact"),
    "smollm3 (NoPE layers)": ("smollm3", {"no_rope_layer_interval": 2}, "exact"),
    "gpt-neox (partial rotary)": ("gpt_neox", {"rotary_pct": 0.5}, "exact"),
    "gemma2 (sliding + full, soft-capping)": ("gemma2", MIXED, "exact"),
    "gemma3 (sliding + full)": ("gemma3_text", MIXED, "exact"),
    "gpt-oss (sliding + full, sinks)": ("gpt_oss", {**MIXED, **MOE}, "exact"),
    "cohere2 (sliding + full)": ("cohere2", MIXED, "exact"),
    "deepseek-v3 (latent attention)": (
        "deepseek_v3",
        dict(
            kv_lora_rank=32,
            q_lora_rank=None,
            head_dim=8,  # the rotary width: qk_rope_head_dim
            num_key_value_heads=4,  # MLA expands the latent to every head
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            moe_intermediate_size=32,
        ),
        "exact",
    ),
    "gemma4 (sliding + global of other head sizes, shared KV)": (
        "gemma4_text",
        dict(
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            num_hidden_layers=4,
            sliding_window=WINDOW,
            global_head_dim=32,  # the sliding layers' is 16 (COMMON)
            num_kv_shared_layers=2,  # layers 2 and 3 attend with layers 0 and 1's KV
            vocab_size_per_layer_input=49152,
            hidden_size_per_layer_input=16,
        ),
        "exact",
    ),
    "qwen3.5 (Gated DeltaNet + full)": (
        "qwen3_5_text",
        dict(layer_types=["linear_attention", "full_attention"], **LINEAR),
        "exact",
    ),
    "qwen3-next (Gated DeltaNet + full, MoE)": (
        "qwen3_next",
        dict(
            layer_types=["linear_attention", "full_attention"],
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            **LINEAR,
        ),
        "exact",
    ),
    "lfm2 (short convolutions + full)": ("lfm2", dict(layer_types=["conv", "full_attention"]), "exact"),
    "nemotron-h (Mamba2 + attention + MLP layers)": (
        "nemotron_h",
        dict(
            layer_types=["linear_attention", "full_attention", "mlp"],
            num_hidden_layers=3,
            mamba_num_heads=4,
            mamba_head_dim=32,
            ssm_state_size=16,
            n_groups=1,
        ),
        "exact",
    ),
    "falcon-h1 (Mamba2 beside attention in every layer)": (
        "falcon_h1",
        {"mamba_d_ssm": 64, "mamba_n_heads": 4, "mamba_d_state": 16},
        "exact",
    ),
    "granite 4 hybrid (Mamba2 + attention)": (
        "granitemoehybrid",
        dict(layer_types=["linear_attention", "full_attention"], **MAMBA2),
        "exact",
    ),
    "jamba (Mamba + attention)": (
        "jamba",
        dict(attn_layer_period=2, attn_layer_offset=1, num_experts=2, mamba_d_state=16),
        "refused",
    ),
}


def build(family: str, folder: Path, **overrides) -> Path:
    """Save a tiny random model of `family` (a FAMILIES key) with SmolLM2's tokenizer in `folder`;
    `overrides`: config fields beside the family's (vLLM's CPU attention takes heads of 32 and up)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ragkv.model.llm import bundled_smollm2_path

    model_type, extra, _ = FAMILIES[family]
    config = AutoConfig.for_model(model_type, **{**COMMON, **extra, **overrides})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    _slow_fading_state(model)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer_dir = bundled_smollm2_path()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tokenizer_dir / name, folder / name)
    return folder


HYBRID = [  # recurrent state beside attention, and Gemma 4's layer groups: through every path
    "gemma4 (sliding + global of other head sizes, shared KV)",
    "qwen3.5 (Gated DeltaNet + full)",
    "qwen3-next (Gated DeltaNet + full, MoE)",
    "lfm2 (short convolutions + full)",
    "nemotron-h (Mamba2 + attention + MLP layers)",
    "falcon-h1 (Mamba2 beside attention in every layer)",
    "granite 4 hybrid (Mamba2 + attention)",
]
STATEFUL = HYBRID[1:]  # the ones with a recurrent state


def _slow_fading_state(model) -> None:
    """Give recurrent layers (Gated DeltaNet, Mamba2) a state that fades slowly, as trained
    models' long-memory heads do. At random initialisation many heads forget their state within a
    token or two, and then a wrong state changes nothing a test could see: with this one, the
    prefix's state still shapes the question's tokens."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("A_log"):
                parameter.fill_(math.log(0.1))  # decay rate A = -0.1
            elif name.endswith("dt_bias"):
                parameter.fill_(-2.0)  # step softplus(-2) = 0.13: about 1% of the state fades per token


def exact_families() -> list[str]:
    return [name for name, (_, _, verdict) in FAMILIES.items() if verdict == "exact"]


def refused_families() -> list[str]:
    return [name for name, (_, _, verdict) in FAMILIES.items() if verdict == "refused"]
