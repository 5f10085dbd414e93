"""The prompt, defined by token ids so the cached path and the full prefill see the same ids.

Layout (chat template of the model, rendered around sentinels, then cut into pieces):

    prefix   = template head + system prompt + user turn head + "Context:\\n"   (cached once)
    chunk_1  [+ separator + chunk_2 ...]                                      (cached per chunk)
    question = "\\n\\nQuestion: " + question + end of turn + assistant head     (prefilled live)

Each piece is tokenised on its own and the ids concatenated. Document and question text is
tokenised with special tokens split, so text cannot inject control tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ragkv.core.errors import ModelError
from ragkv.core.keys import digest

CONTEXT_TEMPLATE = "Context:\n{context}\n\nQuestion: {question}"
CHUNK_SEPARATOR = "\n\n"
FALLBACK_TEMPLATE = "{system}\n\n{user}\nAnswer:"  # models without a chat template
_CONTEXT_MARK = "\x00RAGKV_CONTEXT\x00"
_QUESTION_MARK = "\x00RAGKV_QUESTION\x00"
_ANSWER_MARK = "\x00RAGKV_ANSWER\x00"
_NEXT_MARK = "\x00RAGKV_NEXT\x00"


def _turn_head(tokenizer, system_prompt: str, user: str, question_tail: str) -> tuple[int, ...] | None:
    """The template text between an assistant answer and the next user message, provided
    every user turn ends the same way (so turns can be appended by ids)."""
    messages = [
        {"role": "system", "content": system_prompt},
        {"role": "user", "content": user},
        {"role": "assistant", "content": _ANSWER_MARK},
        {"role": "user", "content": _NEXT_MARK},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if rendered.count(_ANSWER_MARK) != 1 or rendered.count(_NEXT_MARK) != 1:
        return None
    before_answer, after_answer = rendered.split(_ANSWER_MARK)
    between, tail = after_answer.split(_NEXT_MARK)
    if not before_answer.endswith(question_tail) or tail != question_tail:
        return None
    return tuple(_encode_template(tokenizer, between))


def encode_text(tokenizer, text: str) -> list[int]:
    """Token ids of user-supplied text: no BOS/EOS added, special-token strings kept as text."""
    return tokenizer(text, add_special_tokens=False, split_special_tokens=True).input_ids


def _encode_template(tokenizer, text: str) -> list[int]:
    """Token ids of template text, whose special-token strings are real control tokens."""
    return tokenizer(text, add_special_tokens=False).input_ids


@dataclass(frozen=True)
class PromptLayout:
    prefix_ids: tuple[int, ...]
    separator_ids: tuple[int, ...]
    question_head_ids: tuple[int, ...]
    question_tail_ids: tuple[int, ...]
    template_fingerprint: str  # chat template + context template + system prompt
    turn_head_ids: tuple[int, ...] | None = None  # after an answer, before the next user message

    @classmethod
    def build(cls, tokenizer, system_prompt: str) -> PromptLayout:
        template = getattr(tokenizer, "chat_template", None)
        user = CONTEXT_TEMPLATE.format(context=_CONTEXT_MARK, question=_QUESTION_MARK)
        if template:
            messages = [{"role": "system", "content": system_prompt}, {"role": "user", "content": user}]
            rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        else:
            rendered = FALLBACK_TEMPLATE.format(system=system_prompt, user=user)
        if rendered.count(_CONTEXT_MARK) != 1 or rendered.count(_QUESTION_MARK) != 1:
            raise ModelError(
                "the model's chat template does not place the user message verbatim; ragkv cannot split it"
            )
        head, rest = rendered.split(_CONTEXT_MARK)
        middle, tail = rest.split(_QUESTION_MARK)
        return cls(
            prefix_ids=tuple(_encode_template(tokenizer, head)),
            separator_ids=tuple(encode_text(tokenizer, CHUNK_SEPARATOR)),
            question_head_ids=tuple(_encode_template(tokenizer, middle)),
            question_tail_ids=tuple(_encode_template(tokenizer, tail)),
            template_fingerprint=digest(
                template or FALLBACK_TEMPLATE, CONTEXT_TEMPLATE, CHUNK_SEPARATOR, system_prompt
            ),
            turn_head_ids=_turn_head(tokenizer, system_prompt, user, tail) if template else None,
        )

    def turn_ids(self, tokenizer, message: str) -> list[int]:
        """Ids that follow an answer in a conversation: end of that turn, the user's next
        message, end of turn, answer head."""
        if self.turn_head_ids is None:
            raise ModelError("this model has no chat template; multi-turn conversations need one")
        return [*self.turn_head_ids, *encode_text(tokenizer, message), *self.question_tail_ids]

    def question_ids(self, tokenizer, question: str) -> list[int]:
        """Ids that follow the context: question head, the question, end of turn, answer head."""
        return [*self.question_head_ids, *encode_text(tokenizer, question), *self.question_tail_ids]

    def context_ids(self, chunk_ids: Sequence[Sequence[int]]) -> list[int]:
        """Chunks joined by the separator (no prefix, no question)."""
        ids: list[int] = []
        for i, chunk in enumerate(chunk_ids):
            if i:
                ids.extend(self.separator_ids)
            ids.extend(chunk)
        return ids

    def prompt_ids(self, chunk_ids: Sequence[Sequence[int]], question_ids: Sequence[int]) -> list[int]:
        """The whole prompt: prefix + context + question ids."""
        return [*self.prefix_ids, *self.context_ids(chunk_ids), *question_ids]

    @property
    def num_overhead_tokens(self) -> int:
        """Template tokens around the context and question (prefix + question head and tail)."""
        return len(self.prefix_ids) + len(self.question_head_ids) + len(self.question_tail_ids)
