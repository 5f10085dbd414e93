"""What an ingest refuses before it writes anything, each in one line: an engine that cannot do
what is asked, and chunk or span sizes the model's context cannot hold after the system prompt.
(An embedder other than the store's: ragkv.pipelines.embedding.)"""

from __future__ import annotations

import logging
from pathlib import Path

from ragkv.core.config import IngestSettings
from ragkv.core.errors import InputError
from ragkv.model.llm import LoadedModel
from ragkv.model.prompt import PromptLayout
from ragkv.pipelines.engines import vllm_engine
from ragkv.pipelines.to_compute import PendingChunk

# What runs the model, as `ragkv serve --engine` names it too: ragkv's own engine in this
# process, a Ray Data job of it, or vLLM. "local" is the old name of "ragkv".
log = logging.getLogger("ragkv")

ENGINES = ("ragkv", "ray", "vllm")
OLD_NAMES = {"local": "ragkv"}


ROOM_FOR_QUESTION = 64  # tokens a chunk must leave free in the context for question and answer


def chunk_room(lm: LoadedModel, layout: PromptLayout) -> int:
    """Most tokens a chunk may have: the context less the prefix and room to ask and answer."""
    return lm.facts.max_context - len(layout.prefix_ids) - ROOM_FOR_QUESTION


def engine_named(engine: str) -> str:
    """The engine `engine` names (an old name said once, in the log, with the new one)."""
    if engine in OLD_NAMES:
        log.warning("--engine %s is now --engine %s", engine, OLD_NAMES[engine])
        return OLD_NAMES[engine]
    return engine


def for_engine(engine: str, store: Path | str, settings: IngestSettings) -> IngestSettings:
    """`settings` checked against the engine that computes the KV (and, for vLLM, the store)."""
    if engine not in ENGINES:
        raise InputError(f"unknown --engine {engine!r}; use one of {', '.join(ENGINES)}")
    if engine == "ray" and settings.span_tokens:
        raise InputError("--span-tokens runs with --engine ragkv or vllm (the Ray job computes chunks one by one)")
    if engine == "vllm":
        vllm_engine.check(store, settings)
    return settings


def check_fits(lm: LoadedModel, layout: PromptLayout, tokens: int, option: str) -> None:
    """`option`'s `tokens` (of a chunk or a span) fit the model's context after the prefix."""
    if tokens > chunk_room(lm, layout):
        raise InputError(
            f"{option} {tokens} does not fit the model's context of {lm.facts.max_context} tokens "
            f"with the {len(layout.prefix_ids)}-token system prompt; use at most {chunk_room(lm, layout)}"
        )


def check_chunks_fit(pending: list[PendingChunk], lm: LoadedModel, layout: PromptLayout) -> None:
    """Chunks cut under another tokenizer may count differently under this one."""
    room = chunk_room(lm, layout)
    longest = max((len(p.token_ids) for p in pending), default=0)
    if longest > room:
        raise InputError(
            f"a stored chunk is {longest} tokens for model {lm.facts.name}, more than its context leaves "
            f"room for ({room}); re-chunk with a smaller --chunk-tokens"
        )
