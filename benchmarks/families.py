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
from ragkv.kv.layout import KVLayout, not_plain  # noqa: E402
from ragkv.kv.rope import check_supported  # noqa: E402
from ragkv.model import self_check  # noqa: E402
from ragkv.model.llm import load_model  # noqa: E402
from tests import families  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "families.md"
CHUNK_TOKENS = 512  # a typical RAG chunk, for what sliding layers store beyond their window


def verdicts(family: str, folder: Path) -> dict[str, str]:
    """What ragkv does with one family: each engine and mode, in words."""
    from transformers import AutoConfig

    problem = not_plain(AutoConfig.from_pretrained(folder))
    connector = "taken (plain layout)" if problem is None else "refused: " + problem.split(" ", 1)[1]
    try:
        lm = load_model(str(folder), "cpu", "float32")
    except ModelError as exc:
        refusal = f"refused: {str(exc).split(': its cache keeps ')[-1].split(',')[0]}"
        return {"class": str(exc).split()[3], "layout": "-", "engine": refusal, "approx": "refused", "vllm": connector}
    check = self_check.run(lm.model, lm.tokenizer, "float32", lm.pad_id)
    layout = lm.facts.layout
    try:
        check_supported(lm.model)
        approx = "available (approximate)"
    except ModelError as exc:
        approx = "refused (" + ("sliding or latent layers" if not layout.is_plain else "its rotary embedding") + ")"
        assert "Use --mode exact" in str(exc) or "use --mode exact" in str(exc)
    windows = ", ".join("full" if w is None else f"sliding {w}" for w in layout.windows)
    return {
        "class": check.model_class,
        "layout": f"`{layout.name}` ({windows})",
        "engine": f"{'exact' if check.passed else 'REFUSED'} (self-test {check.difference:.0e})",
        "approx": approx,
        "vllm": connector,
    }


def reference_layout(model_type: str) -> tuple[KVLayout, str]:
    """The layout of transformers' default config of `model_type`, without weights, and its size."""
    from transformers import AutoConfig, DynamicCache

    config = AutoConfig.for_model(model_type)
    text = config.get_text_config()
    windows = tuple(getattr(layer, "sliding_window", None) for layer in DynamicCache(config=config).layers)
    if getattr(text, "kv_lora_rank", None):  # transformers caches the latent and the shared rotary key
        layout = KVLayout(1, text.kv_lora_rank, text.qk_rope_head_dim, windows)
    else:
        heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        layout = KVLayout(heads, head_dim, head_dim, windows)
    return layout, f"{len(windows)} layers, hidden {text.hidden_size}"


def stored_bytes(layout: KVLayout, tokens: int) -> int:
    """Bytes the store keeps of an entry of `tokens` tokens in bfloat16, as codec.encode lays it out."""
    import torch

    from ragkv.kv import codec

    entry = torch.zeros(layout.shape(tokens), dtype=torch.bfloat16)
    return sum(t.numel() * t.element_size() for t in codec.encode(entry, "none", layout.windows).values())


def bytes_rows() -> list[str]:
    rows = []
    for model_type in ("llama", "mistral", "gemma2", "gemma3_text", "gpt_oss", "cohere2", "deepseek_v3"):
        layout, size = reference_layout(model_type)
        every = layout.bytes_per_token(2)
        stored = stored_bytes(layout, CHUNK_TOKENS) / CHUNK_TOKENS
        other = f"every token: {every / 1024:,.1f} KiB ({every / stored:.2f}x)" if any(layout.windows) else ""
        if layout.is_packed:
            from transformers import AutoConfig

            text = AutoConfig.for_model(model_type)
            decompressed = layout.num_layers * text.num_attention_heads * (text.qk_head_dim + text.v_head_dim) * 2
            other = f"decompressed K and V per head: {decompressed / 1024:,.1f} KiB ({decompressed / stored:.0f}x)"
        sliding = sum(1 for w in layout.windows if w)
        windows = (
            f"{sliding} of {layout.num_layers} sliding ({max(w for w in layout.windows if w)})" if sliding else "-"
        )
        rows.append(
            f"| {model_type} | {size} | `{layout.name}` | {windows} | {stored / 1024:,.1f} KiB | {other or '-'} |"
        )
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
        "difference from a full prefill, relative to the largest logit (float32; it refuses above 1e-05). "
        "tests/test_families.py runs the self-test on every exact family, and takes the sliding and latent "
        "ones (Mistral with a window, Gemma 2, Gemma 3, gpt-oss, Cohere2, DeepSeek-V3) through ingest, ask, "
        "several chunks, spans, conversations and the batcher against full prefills. *vLLM*: the connector, `ingest --engine vllm` and "
        "`serve --engine vllm`, which refuse what they cannot move before vLLM starts; *taken* means the "
        "connector accepts the layout (tests/test_vllm.py checks its answers live on a Llama model only).",
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
        "## Bytes per token",
        "",
        "Of transformers' default config of each family (its reference size), bfloat16, for a chunk of "
        f"{CHUNK_TOKENS} tokens, as the store keeps it: full-attention layers every token, a sliding layer its "
        "last `window - 1` tokens (all that a continuation reads; `ragkv.kv.codec`'s windowed form). The last "
        "column is the other choice: every token of every layer (what the cache holds in memory), or, for a "
        "latent, keys and values per head. A latent (multi-head latent attention) is stored as transformers "
        "caches it.",
        "",
        "| family | config | layout | sliding layers (window) | stored per token | the other choice per token |",
        "|---|---|---|---|---|---|",
        *bytes_rows(),
        "",
    ]
    OUT.write_text("\n".join(lines))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
