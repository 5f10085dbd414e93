"""Several stores on one loaded model: a `Lane` is another store's runtime on a running engine.

`ragkv serve --store a=PATH --store b=PATH` loads the model once. The first store's engine steps
every request; the other stores' engines are lanes into it, so their questions open
conversations over their own runtime (their store, retriever and KV loader) and decode in the
same batch as everyone else's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ragkv.core.config import AskSettings
from ragkv.engine.answer import Answer, AnswerStream
from ragkv.engine.conversation import Conversation
from ragkv.engine.engine import Engine
from ragkv.engine.request import Request
from ragkv.engine.runtime import Runtime


class Lane:
    """`engine`, answering over `runtime`: new questions and conversations use it; everything
    else (submitting turns, calls between steps, the batch's state) is the engine's own."""

    def __init__(self, engine: Engine, runtime: Runtime):
        if runtime.lm is not engine.runtime.lm:
            raise ValueError("a lane's runtime must use its engine's loaded model")
        self.engine = engine
        self.runtime = runtime

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def conversation(self, settings: AskSettings, history: Sequence[tuple[str, str]] = ()) -> Conversation:
        return self.engine.conversation(settings, history, self.runtime)

    def submit_question(
        self,
        question: str,
        settings: AskSettings,
        history: Sequence[tuple[str, str]] = (),
        on_text: Callable[[str], None] | None = None,
    ) -> Request:
        return self.engine.submit_question(question, settings, history, on_text, self.runtime)

    def ask_stream(self, question: str, settings: AskSettings, history: Sequence[tuple[str, str]] = ()) -> AnswerStream:
        return self.engine.ask_stream(question, settings, history, self.runtime)

    def ask(self, question: str, settings: AskSettings) -> Answer:
        return self.engine.ask(question, settings, self.runtime)
