"""Time to first token from the store against a full prefill, for a hybrid model (recurrent state
beside attention), side by side in one run.

A random-weight model of Qwen3.5's kind (Gated DeltaNet layers, one full-attention layer in four;
~0.5B parameters: 24 layers, hidden 1024) with SmolLM2's tokenizer, float32, at documents of
1k, 2k and 4k tokens, each stored as one chunk (its KV and the recurrent layers' state after it).
Medians of --repeats interleaved runs (spread in parentheses), all warm, retrieval excluded:
- full: a full prefill of the prompt (system prompt, document, question);
- cached: ragkv's path from the store (catalog lookup, shard read + checksum of the KV and the
  state, cache assembly, question prefill, first token), RAM tier off;
and the bytes of each stored entry: its KV, its state.

    python benchmarks/hybrid_ttft.py [--repeats 3]   # ~10 min on 2 cores; writes results/hybrid_ttft.md
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import ragkv  # noqa: E402
from benchmarks.machine import describe  # noqa: E402
from benchmarks.ttft import QUESTION, median_spread, save_with_tokenizer, write_documents  # noqa: E402
from ragkv.core.config import IngestSettings, ModelSettings, cache_dir  # noqa: E402
from ragkv.core.lru import ByteLRU  # noqa: E402
from ragkv.kv import codec  # noqa: E402
from ragkv.store import open_snapshot  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "hybrid_ttft.md"
LENGTHS = (1024, 2048, 4096)


def hybrid_model() -> Path:
    """A random-weight Qwen3.5-kind model (18 Gated DeltaNet layers, 6 full-attention layers,
    hidden 1024), built once into the cache, with SmolLM2's tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = cache_dir() / "bench" / "qwen3.5-kind-0.5b"
    if (folder / "config.json").is_file():
        return folder
    config = AutoConfig.for_model(
        "qwen3_5_text",
        vocab_size=49152,
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=24,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 6,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        linear_num_key_heads=8,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(0)
    return save_with_tokenizer(AutoModelForCausalLM.from_config(config), folder)


def entry_bytes(store: Path) -> dict[str, tuple[int, int]]:
    """Each chunk entry's stored bytes, `doc id -> (KV bytes, state bytes)`."""
    found = {}
    with open_snapshot(store) as snapshot:
        profile = snapshot.catalog.entries.profiles()[0].profile_id
        rows = snapshot.catalog.entries.context_rows(profile, sorted(snapshot.catalog.documents.chunk_ids()))
        for row in rows:
            parts = snapshot.shards.layout(row.entry.shard, row.entry.tensor)
            sizes = {name: shape.numel() * dtype.itemsize for name, (dtype, shape) in _shapes(parts).items()}
            state = sum(size for name, size in sizes.items() if name.startswith(codec.STATE_PREFIX))
            found[row.doc_id] = (sum(sizes.values()) - state, state)
    return found


def _shapes(parts: dict) -> dict:
    return {name: (dtype, torch.Size(shape)) for name, (dtype, shape) in parts.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model = hybrid_model()
    params = sum(math.prod(tensor.get_shape()) for tensor in _weights(model))
    with tempfile.TemporaryDirectory() as tmp:
        from transformers import AutoTokenizer

        docs = write_documents(Path(tmp) / "docs", AutoTokenizer.from_pretrained(model), LENGTHS)
        store = Path(tmp) / "store"
        settings = IngestSettings(chunk_tokens=max(LENGTHS) + 64, shard_bytes=64 << 20)
        ragkv.ingest(
            [Path(tmp) / "docs"],
            store=store,
            model=ModelSettings(model=str(model), device="cpu", dtype="float32"),
            settings=settings,
        )
        sizes = entry_bytes(store)
        rows = []
        with ragkv.open(store, device="cpu") as engine:
            engine.ram = ByteLRU(0)
            layout = engine.lm.facts.layout
            for length, doc in docs.items():
                engine.ask(QUESTION, doc_ids=[doc], max_new_tokens=1)  # warm: pages, kernels
                full, cached = [], []
                for _ in range(args.repeats):
                    stats = engine.ask(QUESTION, doc_ids=[doc], max_new_tokens=1, use_cache=False).stats
                    full.append(stats.ttft_s - stats.retrieval_ms / 1000)
                    stats = engine.ask(QUESTION, doc_ids=[doc], max_new_tokens=1).stats
                    assert stats.mode == "exact" and stats.reused_tokens > 0, stats
                    cached.append(stats.ttft_s - stats.retrieval_ms / 1000)
                rows.append(
                    (
                        length,
                        stats.reused_tokens + stats.computed_tokens,
                        median_spread(full),
                        median_spread(cached),
                        sizes[doc],
                    )
                )
                print(f"{length}: full {rows[-1][2][0]:.2f} s, cached {rows[-1][3][0]:.3f} s", file=sys.stderr)
    lines = [
        "# Hybrid model: time to first token from the store",
        "",
        f"Generated by `python benchmarks/hybrid_ttft.py --repeats {args.repeats}` on {describe()}.",
        f"A random-weight model of Qwen3.5's kind ({params / 1e6:.0f}M parameters: "
        f"{layout.num_layers} layers, {len(layout.states) // 2} Gated DeltaNet, {layout.groups[0].num_layers} "
        "full attention, hidden 1024), float32, each document one stored chunk. TTFT excludes retrieval; "
        f"medians of {args.repeats} interleaved runs (min-max). *full*: the whole prompt prefilled; "
        "*cached*: the chunk's KV and the recurrent state after it read from the store (checksummed), "
        "the question prefilled on top. Token counts are the whole prompt's.",
        "",
        "| document | prompt tokens | full prefill | from the store | speed-up | KV stored | state stored | state / KV |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for length, tokens, full, cached, (kv_bytes, state_bytes) in rows:
        lines.append(
            f"| {length} | {tokens} | {full[0]:.2f} s ({full[1]:.2f}-{full[2]:.2f}) | "
            f"{cached[0]:.3f} s ({cached[1]:.3f}-{cached[2]:.3f}) | {full[0] / cached[0]:.1f}x | "
            f"{kv_bytes / 2**20:.1f} MiB | {state_bytes / 2**20:.1f} MiB | {state_bytes / kv_bytes:.2f} |"
        )
    lines += [
        "",
        f"The state is {layout.state_bytes / 2**20:.1f} MiB whatever the entry's length (float32, as the "
        "model keeps it); the KV grows with the tokens "
        f"({layout.bytes_per_token(4) / 1024:.0f} KiB per token in float32, {layout.groups[0].num_layers} layers).",
        "",
    ]
    OUT.write_text("\n".join(lines))
    print(f"wrote {OUT}")


def _weights(folder: Path):
    from safetensors import safe_open

    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                yield handle.get_slice(name)


if __name__ == "__main__":
    main()
