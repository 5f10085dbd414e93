"""ragkv: compute each document's KV cache once, answer RAG questions by prefilling only the question.

    import ragkv
    ragkv.ingest(["data/"], store="./kvstore")
    with ragkv.open("./kvstore") as rag:
        answer = rag.ask("How do I rotate the API key?")
        print(answer.text, answer.sources, answer.stats)
        for text in (stream := rag.stream("Who approves leave?")):
            print(text, end="")

Heavy imports (torch, transformers) happen on first use, so `store` (which imports
`ragkv.core.errors` and `ragkv.core.keys`) stays light.
"""

from ragkv.core.errors import (
    InputError,
    ModelError,
    RagkvError,
    StoreCorruptError,
    StoreEmptyError,
    StoreFormatError,
    StoreLockedError,
    StoreNotFoundError,
)
from ragkv.core.formats import __version__ as __version__  # re-exported: ragkv.__version__

__all__ = [
    "open",
    "ingest",
    "QueryEngine",
    "Answer",
    "AskSettings",
    "IngestSettings",
    "ModelSettings",
    "Scope",
    "RagkvError",
    "InputError",
    "ModelError",
    "StoreCorruptError",
    "StoreEmptyError",
    "StoreFormatError",
    "StoreLockedError",
    "StoreNotFoundError",
]


def open(store, model=None, embedder=None, device="auto", dtype=None, **options):  # noqa: A001 - the API's verb
    """Open a store for questions: `ragkv.open("./kvstore").ask("...")`. Options as for
    `QueryEngine` (kv_dtype, ram_bytes, prefix_cache_bytes; `scope`, a `ragkv.Scope` or a mapping
    with tenant and filters, bounds every call: see ragkv.core.scope)."""
    from ragkv.engine.query import QueryEngine

    return QueryEngine(store, model=model, embedder=embedder, device=device, dtype=dtype, **options)


def ingest(paths, store, model=None, settings=None, reporter=None, wait=False, prune=False, engine="ragkv", workers=0):
    """Ingest documents (files or directories) into a store (a folder or s3://bucket/prefix);
    returns an `IngestReport`. `model` is a `ModelSettings`, `settings` an `IngestSettings`
    (defaults if omitted); `engine="ray"` runs embedding and KV as a Ray Data job."""
    from ragkv.pipelines.ingest import ingest as run

    if isinstance(paths, (str, bytes)) or hasattr(paths, "__fspath__"):
        paths = [paths]
    return run(
        paths,
        store,
        model=model,
        settings=settings,
        reporter=reporter,
        wait=wait,
        prune=prune,
        engine=engine,
        workers=workers,
    )


def __getattr__(name):
    if name == "QueryEngine":
        from ragkv.engine.query import QueryEngine

        return QueryEngine
    if name == "Answer":
        from ragkv.engine.answer import Answer

        return Answer
    if name == "Scope":
        from ragkv.core.scope import Scope

        return Scope
    if name in ("AskSettings", "IngestSettings", "ModelSettings"):
        from ragkv.core import config

        return getattr(config, name)
    raise AttributeError(f"module 'ragkv' has no attribute {name!r}")
