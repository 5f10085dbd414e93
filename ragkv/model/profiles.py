"""Which stored profile a model's KV is: the one home of choosing among a store's profiles,
for an engine that loads the model (ragkv.engine.active) and for a serving engine that runs it
(ragkv.integrations.store_match)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ragkv.core.keys import Profile
from ragkv.model.prompt import PromptLayout


@dataclass(frozen=True)
class ActiveProfile:
    """The stored profile an engine answers with, checked against the live model."""

    profile: Profile
    layout: PromptLayout
    system_prompt: str


def candidates(rows: Sequence, last: str | None, fingerprint: str, dtype: str, kv_quant: str | None = None) -> list:
    """The stored profile rows a model with weights `fingerprint` computes in `dtype` (stored
    as `kv_quant`, when given), the store's last used first."""
    found = [
        r
        for r in rows
        if r.model_fingerprint == fingerprint and r.dtype == dtype and (kv_quant is None or r.kv_quant == kv_quant)
    ]
    return sorted(found, key=lambda r: r.profile_id != last)


def first_matching(
    rows: Sequence, fingerprint: str, tokenizer_fingerprint: str, tokenizer, kv_layout: str = ""
) -> ActiveProfile | None:
    """The first of `rows` whose tokenizer and template `tokenizer` lays out the same (and whose
    KV layout key is `kv_layout`), as the profile it answers with; None when none does."""
    for row in rows:
        layout = PromptLayout.build(tokenizer, row.system_prompt)
        profile = Profile.from_row(row, fingerprint, tokenizer_fingerprint, layout, kv_layout)
        if profile is not None:
            return ActiveProfile(profile, layout, row.system_prompt)
    return None
