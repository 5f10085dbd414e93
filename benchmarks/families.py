"""The families table: which model families ragkv serves exactly, in which engine and mode, and
how many bytes a token of each stored layout takes. Generated, never written by hand.

For each family of tests/families.py, a tiny random model is built, loaded as `ragkv` loads
any model (a family it refuses says so here in its own words), and put through the self-test
(`ragkv.model.self_check`: first-token logits from stored KV against a full prefill). The engine
tests (tests/test_families.py) check the same families through ingest, ask, spans,
conversations and the batcher. Bytes per token come from transformers' default config of each
family (its reference size), computed as the store lays it out.

    python benchmarks/families.py      # ~1 min; writes benchmarks/results/families.md
"""

from __future__ import annotations

import logging
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.machine import describe as describe_machine  # noqa: E402
from ragkv.core.errors import ModelError  # noqa: E402
from ragkv.kv.layout import KVLayout  # noqa: E402
from ragkv.kv.movable import not_movable  # noqa: E402
from ragkv.kv.rope import check_supported  # noqa: E402
from ragkv.model import self_check  # noqa: E402
from ragkv.model.llm import load_model  # noqa: E402
from tests import families  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "families.md"
CHUNK_TOKENS = 512  # a typical RAG chunk, for what sliding layers store beyond their window


def verdicts(family: str, folder: Path) -> dict[str, str]:
    """What ragkv does with one family: each engine and mode, in words."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    problem = not_movable(config)
    connector = "taken" if problem is None else "refused: " + problem.split(" ", 1)[1]
    if problem is None and not_movable(config, saves=True) is not None:
        connector = "loads KV and state; saves none"
    try:
        lm = load_model(str(folder), "cpu", "float32")
    except ModelError as exc:
        why = str(exc).split(" exactly: ", 1)[-1].split(";")[0]
        return {
            "class": str(exc).split()[3],
            "layout": "-",
            "engine": f"refused: {why}",
            "approx": "refused",
            "vllm": connector,
        }
    check = self_check.run(lm.model, lm.tokenizer, "float32", lm.pad_id)
    layout = lm.facts.layout
    try:
        check_supported(lm.model)
        approx = "available (approximate)"
    except ModelError as exc:
        approx = "refused (" + ("its layers" if not layout.is_plain else "its rotary embedding") + ")"
        assert "Use --mode exact" in str(exc) or "use --mode exact" in str(exc)
    return {
        "class": check.model_class,
        "layout": f"`{layout.name}` ({', '.join(layout.describe_layers())})",
        "engine": f"{'exact' if check.passed else 'REFUSED'} (self-test {check.difference:.0e})",
        "approx": approx,
        "vllm": connector,
    }


# Reference sizes: transformers' default config of each family, except where that default is not
# the hybrid the family publishes (all attention, all Mamba, or 4 layers): there, the layer pattern
# named in the row's config column on transformers' default sizes.
_NEMOTRON_H_52 = "".join("*" if i in (7, 18, 29, 40) else "M" if i % 2 == 0 else "-" for i in range(52))
REFERENCES: dict[str, tuple[dict, str]] = {
    "llama": ({}, ""),
    "mistral": ({}, ""),
    "gemma2": ({}, ""),
    "gemma3_text": ({}, ""),
    "gemma4_text": ({}, ""),
    "gpt_oss": ({}, ""),
    "cohere2": ({}, ""),
    "deepseek_v3": ({}, ""),
    "qwen3_5_text": ({}, ""),
    "qwen3_next": ({}, ""),
    "falcon_h1": ({}, ""),
    "lfm2": (
        dict(
            hidden_size=2048,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            full_attn_idxs=[2, 5, 8, 10, 12, 14],
        ),
        "LFM2-1.2B's shape: 16 layers, 6 attention",
    ),
    "granitemoehybrid": (
        dict(layer_types=["full_attention" if i % 8 == 7 else "linear_attention" for i in range(32)]),
        "1 attention layer in 8",
    ),
    "nemotron_h": (
        dict(num_hidden_layers=52, hybrid_override_pattern=_NEMOTRON_H_52),
        "52 layers: 24 Mamba2, 4 attention, 24 MLP",
    ),
}


def reference_layout(model_type: str) -> tuple[KVLayout, str]:
    """The layout of a family's reference config (`REFERENCES`) and its size, read off a model
    on the meta device (shapes, no weights) in bfloat16, as ragkv reads any model's."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

    from ragkv.kv.layout import read_layout

    overrides, note = REFERENCES[model_type]
    config = AutoConfig.for_model(model_type, **overrides)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    cache = DynamicCache(config=config)
    with torch.inference_mode():
        model(input_ids=torch.zeros((1, 2), dtype=torch.long, device="meta"), cache=cache, use_cache=True)
    text = config.get_text_config()
    size = f"{text.num_hidden_layers} layers, hidden {text.hidden_size}" + (f" ({note})" if note else "")
    return read_layout(cache, model_type), size


def stored_bytes(layout: KVLayout, tokens: int) -> tuple[int, int]:
    """Bytes the store keeps of an entry of `tokens` tokens in bfloat16, as codec.encode lays it
    out: (its KV, its state)."""
    import torch

    from ragkv.kv import codec
    from ragkv.kv.entry import Entry

    groups = tuple(torch.zeros(g.shape(tokens), dtype=torch.bfloat16) for g in layout.groups)
    state = {s.name: torch.zeros(s.shape, dtype=s.torch_dtype) for s in layout.states}
    parts = codec.encode(Entry(groups, state or None), "none", layout)
    sizes = {name: t.numel() * t.element_size() for name, t in parts.items()}
    state_bytes = sum(size for name, size in sizes.items() if name.startswith(codec.STATE_PREFIX))
    return sum(sizes.values()) - state_bytes, state_bytes


def bytes_rows() -> list[str]:
    rows = []
    for model_type in REFERENCES:
        layout, size = reference_layout(model_type)
        kv_bytes, state_bytes = stored_bytes(layout, CHUNK_TOKENS)
        per_token = kv_bytes / CHUNK_TOKENS
        kinds = layout.describe_layers()
        counted = [f"{kinds.count(kind)} {kind}" for kind in dict.fromkeys(kinds)]
        shapes = " + ".join(f"{g.num_layers}x{g.num_heads}x{g.key_dim}" for g in layout.groups)
        if state_bytes:
            dominant = "state" if state_bytes > kv_bytes else "KV"
            chunk = f"KV {kv_bytes / 2**20:,.1f} MiB, state {state_bytes / 2**20:,.1f} MiB: **{dominant}** ({max(kv_bytes, state_bytes) / min(kv_bytes, state_bytes):.1f}x)"
        else:
            chunk = f"KV {kv_bytes / 2**20:,.1f} MiB"
        rows.append(
            f"| {model_type} | {size} | {', '.join(counted)} | {shapes} | {per_token / 1024:,.1f} KiB | "
            f"{state_bytes / 2**20:,.2f} MiB | {chunk} |"
        )
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    logging.disable(logging.WARNING)
    lines = [
        "# Model families",
        "",
        f"Generated by `python benchmarks/families.py` on {describe_machine()}.",
        "Each family is a tiny random model (tests/families.py: 2 layers, hidden 64, sliding windows of "
        f"{families.WINDOW} tokens, shorter than a chunk), loaded as ragkv loads any model. *ragkv engine*: "
        "`ingest`, `ask`, `chat`, `batch`, `serve`; the self-test's number is the largest first-token logit "
        "difference from a full prefill over the question's positions, relative to the largest logit, and of "
        "every recurrent state the two end with (float32; it refuses above 1e-05). Recurrent layers get a state "
        "that fades slowly (tests/families.py says why). tests/test_families.py runs the self-test on every "
        "exact family, refuses a perturbed layer and a perturbed state, and takes the sliding, latent, "
        "several-shape and recurrent ones through ingest, ask, several chunks, spans, conversations and the "
        "batcher against full prefills. *vLLM*: the connector, `ingest --engine vllm` and "
        "`serve --engine vllm`, which refuse what they cannot move before vLLM starts; *taken* means the "
        "connector accepts the layout (tests/test_vllm.py checks Llama, Gemma 3, gpt-oss, Nemotron-H, Falcon-H1 "
        "and Granite 4 live in vLLM's CPU build).",
        "",
        "| family | model class | stored layout (per layer) | ragkv engine | approximate modes | vLLM |",
        "|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for family in families.FAMILIES:
            found = verdicts(family, families.build(family, Path(tmp) / family.split()[0]))
            lines.append(
                f"| {family} | {found['class']} | {found['layout']} | {found['engine']} | {found['approx']} | "
                f"{found['vllm']} |"
            )
            print(lines[-1], flush=True)
    lines += [
        "",
        "## Bytes per entry",
        "",
        "Of each family's reference size (transformers' default config, or the pattern named), bfloat16 "
        "weights, read off the model as ragkv reads any (on the meta device: shapes, no weights), as the store "
        f"keeps a chunk of {CHUNK_TOKENS} tokens: full-attention layers every token, a sliding layer its last "
        "`window - 1` tokens (`ragkv.kv.codec`'s windowed form), a latent as transformers caches it, and each "
        "recurrent layer's state once per entry, whatever its length, in the dtype the model keeps it (float32 "
        "recurrent matrices beside bf16 weights). *KV per token* is the entry's KV over its tokens. Where the "
        "state outweighs the chunk's KV, benchmarks/results/hybrid_ttft.md measures whether reading it still "
        "beats recomputing.",
        "",
        "| family | config | layers | KV groups (layers x heads x head dim) | KV per token | state per entry | "
        f"a {CHUNK_TOKENS}-token chunk |",
        "|---|---|---|---|---|---|---|",
        *bytes_rows(),
        "",
    ]
    OUT.write_text("\n".join(lines))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
