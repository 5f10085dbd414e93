"""The KV of recent conversations `ragkv serve` keeps, so that a follow-up request that repeats
the history prefills only its new message.

Kept by store, scope (tenant and filters) and messages: a tenant sending another's exact history
gets no kept conversation (whose cache holds the other's retrieved documents), but a fresh one
that replays the history over its own scope's retrieval; and a key whose filters were narrowed
(a keys file reloaded) does not continue a conversation retrieved under the wider ones.
"""

from __future__ import annotations

import json

from ragkv.core.config import AskSettings
from ragkv.core.keys import digest
from ragkv.core.lru import ByteLRU


def _history_key(store: str, settings: AskSettings, messages: list[tuple[str, str]]) -> str:
    scope = settings.scope
    who = json.dumps([scope.tenant, list(scope.filters)] if scope is not None else None)
    return digest("ragkv-chat", store, who, json.dumps(messages))


class Conversations:
    """Bounded in bytes; the least recently used go first. Used on the model thread only."""

    def __init__(self, max_bytes: int):
        self._lru: ByteLRU = ByteLRU(max_bytes)

    def take(self, engine, store: str, history: list[tuple[str, str]], settings: AskSettings):
        """A conversation of `engine` (the store `store`'s) holding `history` ((user, assistant)
        pairs): a kept one when the history matches for this tenant, else a new one that
        replays it. Returns it and whether it was kept."""
        key = _history_key(store, settings, history)
        kept = self._lru.pop(key) if history else None
        if kept is not None:
            return kept, True
        return engine.conversation(settings, history), False

    def keep(self, conversation, store: str, history: list[tuple[str, str]], settings: AskSettings) -> None:
        size = conversation.runtime.lm.facts.kv_bytes_per_token * len(conversation.ids())
        self._lru.put(_history_key(store, settings, history), conversation, size=size)
