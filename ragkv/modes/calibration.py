"""What `--mode approximate` means on one store and model: the approximate mode and recompute
share that `ragkv calibrate` measured reaching the target agreement with a full prefill, or
exact answers when none did (the gate). A configuration reaches the target when the lower end
of its agreement's one-sided 90% confidence interval (Wilson's) does, not its mean: on a
dozen questions a mean says little of the questions that come later.

A calibration is kept in the store's catalog meta under `calibration:<profile id>`, as JSON, so
it belongs to one model, tokenizer, template and dtype, like the KV it was measured on. An
explicitly named mode (`--mode epic`, `--blend-ratio ...`) is the caller's choice and is used
as asked; only `approximate` is resolved here.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field

from ragkv.core.config import APPROXIMATE, DEFAULT_BLEND_RATIOS, AskSettings

META_PREFIX = "calibration:"
CONFIDENCE_Z = 1.2816  # one-sided 90%: a configuration passes when its agreement is at least the target with this


def lower_bound(agreed: int, asked: int, z: float = CONFIDENCE_Z) -> float:
    """The lower end of the Wilson score interval of `agreed` out of `asked` (0 when none asked):
    what the agreement is at least, at the interval's confidence. On 12 questions all agreeing
    it is 88%, on 32 it is 95%: a few easy questions do not pass for a mode that holds out."""
    if asked <= 0:
        return 0.0
    share, spread = agreed / asked, z * z / asked
    centre = share + spread / 2
    margin = z * math.sqrt(share * (1 - share) / asked + spread / (4 * asked))
    return max(0.0, (centre - margin) / (1 + spread))


@dataclass(frozen=True)
class Measured:
    """One approximate configuration against a full prefill, on the calibration questions."""

    mode: str
    share: float  # of the context tokens after the first chunk, recomputed
    first_token: float  # share of questions whose first answer token equals the full prefill's
    teacher_forced: float  # share of answer positions whose top token equals the full prefill's
    ttft_ratio: float  # median time to first token over the full prefill's
    first_token_low: float | None = None  # its lower bound (None: recorded before calibration chose by it)

    @property
    def assured(self) -> float:
        """The first-token agreement a configuration is chosen by: the lower bound."""
        return self.first_token if self.first_token_low is None else self.first_token_low


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

    @property
    def best_assured(self) -> float:
        return max((m.assured for m in self.measured), default=0.0)

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
                f"no approximate mode reached {self.target:.0%} first-token agreement at 90% confidence (best "
                f"{self.best_first_token:.0%}, at least {self.best_assured:.0%}) faster than exact"
            )
        c = self.chosen
        return (
            f"{c.mode} {c.share:.0%}: {c.first_token:.0%} first-token (at least {c.assured:.0%} at 90% confidence) "
            f"and {c.teacher_forced:.0%} teacher-forced agreement, {c.ttft_ratio:.2f}x the full prefill's TTFT, "
            f"on {self.num_questions} held-in questions at top-{self.top_k}"
        )


def choose(measured: list[Measured], target: float, exact_ttft_ratio: float) -> Measured | None:
    """The fastest configuration whose agreement is at least `target` at 90% confidence and
    which beats exact's time to first token; None (answer exactly) when none does."""
    passing = [m for m in measured if m.assured >= target and m.ttft_ratio < exact_ttft_ratio]
    return min(passing, key=lambda m: m.ttft_ratio, default=None)


def meta_key(profile_id: str) -> str:
    return META_PREFIX + profile_id


def load(meta: dict[str, str], profile_id: str) -> Calibration | None:
    text = meta.get(meta_key(profile_id))
    return Calibration.from_json(text) if text else None


@dataclass(frozen=True)
class Resolved:
    """What `--mode approximate` runs as, and what to tell the caller (a report for Stats.of:
    its `approximation` and `warnings` become the answer's)."""

    settings: AskSettings
    approximation: str  # which mode and share, and what it measured
    warnings: tuple[str, ...] = ()


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
            (
                f"--mode approximate is not calibrated for this store and model: {APPROXIMATE} {share:.0%} "
                "was used unmeasured; run ragkv calibrate",
            ),
        )
    if calibration.chosen is None:
        return Resolved(
            dataclasses.replace(settings, mode="exact", blend_ratio=0.0),
            "exact (gated)",
            (f"--mode approximate answered exactly: on this store {calibration.describe()}",),
        )
    chosen = calibration.chosen
    share = settings.blend_ratio if settings.blend_ratio is not None else chosen.share
    return Resolved(
        dataclasses.replace(settings, mode=chosen.mode, blend_ratio=share),
        f"{chosen.mode} {share:.0%}, calibrated: {calibration.describe()}",
    )
