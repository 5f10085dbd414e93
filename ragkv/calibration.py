"""What `--mode approximate` means on one store and model: the approximate mode and recompute
share that `ragkv calibrate` measured reaching the target agreement with a full prefill, or
exact answers when none did (the gate).

A calibration is kept in the store's catalog meta under `calibration:<profile id>`, as JSON, so
it belongs to one model, tokenizer, template and dtype, like the KV it was measured on. An
explicitly named mode (`--mode epic`, `--blend-ratio ...`) is the caller's choice and is used
as asked; only `approximate` is resolved here.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from ragkv.config import APPROXIMATE, DEFAULT_BLEND_RATIOS, AskSettings

META_PREFIX = "calibration:"


@dataclass(frozen=True)
class Measured:
    """One approximate configuration against a full prefill, on the calibration questions."""

    mode: str
    share: float  # of the context tokens after the first chunk, recomputed
    first_token: float  # share of questions whose first answer token equals the full prefill's
    teacher_forced: float  # share of answer positions whose top token equals the full prefill's
    ttft_ratio: float  # median time to first token over the full prefill's


@dataclass(frozen=True)
class Calibration:
    target: float  # the first-token agreement asked for
    top_k: int
    num_questions: int
    exact_ttft_ratio: float  # exact mode's time to first token over the full prefill's
    chosen: Measured | None  # the fastest configuration that reached the target (None: none did)
    measured: list[Measured] = field(default_factory=list)  # everything tried, in order

    @property
    def best_first_token(self) -> float:
        return max((m.first_token for m in self.measured), default=0.0)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Calibration:
        data = json.loads(text)
        chosen = Measured(**data["chosen"]) if data.get("chosen") else None
        return cls(
            data["target"],
            data["top_k"],
            data["num_questions"],
            data["exact_ttft_ratio"],
            chosen,
            [Measured(**m) for m in data.get("measured", [])],
        )

    def describe(self) -> str:
        if self.chosen is None:
            return (
                f"no approximate mode reached {self.target:.0%} first-token agreement (best "
                f"{self.best_first_token:.0%}) faster than exact"
            )
        c = self.chosen
        return (
            f"{c.mode} {c.share:.0%}: {c.first_token:.0%} first-token and {c.teacher_forced:.0%} teacher-forced "
            f"agreement, {c.ttft_ratio:.2f}x the full prefill's TTFT, on {self.num_questions} held-in questions "
            f"at top-{self.top_k}"
        )


def meta_key(profile_id: str) -> str:
    return META_PREFIX + profile_id


def load(meta: dict[str, str], profile_id: str) -> Calibration | None:
    text = meta.get(meta_key(profile_id))
    return Calibration.from_json(text) if text else None


@dataclass(frozen=True)
class Resolved:
    """What `--mode approximate` runs as, and what to tell the caller."""

    settings: AskSettings
    note: str  # which mode and share, and what it measured (Stats.approximation)
    warning: str = ""


def resolve(settings: AskSettings, calibration: Calibration | None) -> Resolved:
    """`settings` with `approximate` replaced by what it means on this store (other modes as
    they are). Without a calibration: the default approximate mode, said to be unmeasured. With
    one that no mode passed: exact (the gate), with a warning naming what was measured."""
    if settings.mode != "approximate" or not settings.use_cache:
        return Resolved(settings, "")
    if calibration is None:
        share = settings.blend_ratio if settings.blend_ratio is not None else DEFAULT_BLEND_RATIOS[APPROXIMATE]
        return Resolved(
            dataclasses.replace(settings, mode=APPROXIMATE, blend_ratio=share),
            f"{APPROXIMATE} {share:.0%}, uncalibrated",
            f"--mode approximate is not calibrated for this store and model: {APPROXIMATE} {share:.0%} "
            "was used unmeasured; run ragkv calibrate",
        )
    if calibration.chosen is None:
        return Resolved(
            dataclasses.replace(settings, mode="exact", blend_ratio=0.0),
            "exact (gated)",
            f"--mode approximate answered exactly: on this store {calibration.describe()}",
        )
    chosen = calibration.chosen
    share = settings.blend_ratio if settings.blend_ratio is not None else chosen.share
    return Resolved(
        dataclasses.replace(settings, mode=chosen.mode, blend_ratio=share),
        f"{chosen.mode} {share:.0%}, calibrated: {calibration.describe()}",
    )
