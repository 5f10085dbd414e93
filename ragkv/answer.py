"""What `ask` returns: the answer text and ids, where the context came from, and how long it took."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Source:
    doc_id: str
    source: str  # file path (and jsonl line) the document was read from
    chunk_index: int
    chunk_id: int
    score: float  # cosine similarity of question and chunk


@dataclass
class Stats:
    # "exact" | "concat" | "blend": how stored KV was used; "full": --no-cache; "fallback": a
    # store miss answered with a full prefill
    mode: str
    reused_tokens: int = 0  # prompt tokens whose KV came from the store (or the prefix cache)
    computed_tokens: int = 0  # prompt tokens prefilled now
    recomputed_tokens: int = 0  # blend: context tokens whose stored KV was recomputed
    prefix_cache_tokens: int = 0  # of the reused, those found in the in-process prefix cache
    generated_tokens: int = 0
    retrieval_ms: float = 0.0  # question embedding + vector search + catalog lookup
    kv_load_ms: float = 0.0  # shard read + checksum + cache assembly
    prefill_ms: float = 0.0
    ttft_s: float = 0.0  # from the call to the first answer token
    decode_s: float = 0.0
    total_s: float = 0.0
    finish_reason: str = ""  # "stop" (end of turn) or "length" (max_new_tokens)
    store_generation: int = 0
    warnings: list[str] = field(default_factory=list)

    @property
    def prompt_tokens(self) -> int:
        return self.reused_tokens + self.computed_tokens


@dataclass
class Answer:
    question: str
    text: str
    token_ids: list[int]
    sources: list[Source]
    stats: Stats
    prompt_ids: list[int] = field(default_factory=list, repr=False)  # the exact prompt, for comparisons

    def to_dict(self) -> dict:
        stats = asdict(self.stats)
        stats["prompt_tokens"] = self.stats.prompt_tokens
        return {
            "question": self.question,
            "answer": self.text,
            "token_ids": self.token_ids,
            "sources": [asdict(s) for s in self.sources],
            "stats": stats,
        }
