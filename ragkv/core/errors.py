"""The few named errors ragkv raises. Each message says what was wrong and what to do.

The CLI turns any `RagkvError` into one line on stderr and the exit code named here,
in one place (`cli.main`).
"""


class RagkvError(Exception):
    """Base class: a problem the user can fix. `exit_code` is what the CLI exits with."""

    exit_code = 1


class InputError(RagkvError, ValueError):
    """A path, file, option or question that cannot be used as given. Also a ValueError: what
    Python code, and frameworks such as LangChain and LlamaIndex, raise for bad input."""

    exit_code = 2


class StoreNotFoundError(RagkvError):
    """No ragkv store at the given path."""

    exit_code = 3


class StoreEmptyError(RagkvError):
    """The store exists but holds no documents to answer from."""

    exit_code = 3


class StoreFormatError(RagkvError):
    """The store was written by an unknown (newer) format, or its files are inconsistent."""

    exit_code = 4


class StoreLockedError(RagkvError):
    """Another process is writing the store."""

    exit_code = 5


class ModelError(RagkvError, ValueError):
    """A model or embedder that cannot be found, loaded, or used with this store (a ValueError too)."""

    exit_code = 6


class StoreCorruptError(RagkvError):
    """A stored KV entry is missing, truncated or fails its checksum. Queries fall back to a
    full prefill when they meet one; `ragkv verify` reports them."""

    exit_code = 4


class StoreWriteError(RagkvError):
    """The store could not be written (read-only file system, disk full, permissions). The
    published store is unchanged."""

    exit_code = 7


class OutputError(RagkvError):
    """A file ragkv was asked to write (`batch --out`, `reindex --report`) could not be written
    (disk full, permissions). The store is not touched."""

    exit_code = 7


class MissingExtraError(InputError, ImportError):
    """A part of ragkv used without the optional packages it needs (an ImportError too, so
    `except ImportError` around an optional import keeps working)."""

    def __init__(self, what: str, extra: str, missing: str | None = None):
        lacking = f" ({missing.split('.')[0]} is not installed)" if missing else ""
        super().__init__(f"{what} needs ragkv's '{extra}' extra{lacking}: pip install 'ragkv[{extra}]'")
