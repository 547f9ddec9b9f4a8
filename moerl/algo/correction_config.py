"""Options of the importance-sampling corrections (group `correction`, conf/correction/).

A correction turns the gap between the trainer's and the rollout engine's logprobs (and the
policy version behind each token) into per-token weights and a keep mask; the policy loss
multiplies its per-token terms by the weights. `correction=tis` picks TISConfig; fields
are then overridden as `correction.cap=3`. Torch-free, like `config.py`.

The ratio is trainer/rollout = exp(trainer_logprob - rollout_logprob), taken at a `level`:

    token       each token's own ratio
    sequence    the product over the sequence, exp(sum of log ratios), on all its tokens
    geometric   the geometric mean over the sequence, exp(mean of log ratios), on all its tokens
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moerl.common.checks import at_least, one_of

LEVELS = ("token", "sequence", "geometric")


@dataclass
class CorrectionConfig:
    """The correction slot. The bare config is `none`: weight 1 on every counted token."""

    name: str = "none"
    """Correction registered in moerl.algo.correction.CORRECTIONS; pick one with
    `correction=NAME`."""

    @property
    def reweights(self) -> bool:
        """True if the weights can differ from 1 on kept tokens (an IS weight, not only a
        mask); the trainer's start-up check reads it. Each option overrides it; a bare
        CorrectionConfig means its `name` with default options, so it answers for that."""
        option = CORRECTION_OPTIONS.get(self.name)
        if option is None or isinstance(self, option):
            return False
        return option().reweights

    @property
    def batch_statistic(self) -> bool:
        """True if a token's weight depends on sequences other than its own (a statistic
        over the whole batch, such as batch_normalize): the trainer then computes π_old in
        a separate forward over the batch before the update instead of taking it from the
        training forward, micro-batch by micro-batch (trainer.old_policy_pass)."""
        option = CORRECTION_OPTIONS.get(self.name)
        if option is None or isinstance(self, option):
            return bool(getattr(self, "batch_normalize", False))
        return option().batch_statistic

    def validate(self, key: str) -> None:
        """Raise ValueError naming `key.field` for an out-of-range option."""


@dataclass
class TISConfig(CorrectionConfig):
    """Truncated IS (Yao et al. 2025): weight = clamp(ratio, low, cap); no token is dropped."""

    name: str = "tis"
    """Registered name of this correction."""
    cap: float = 2.0
    """Upper bound C of the weight."""
    low: float = 0.0
    """Lower bound of the weight (slime's --tis-clip-low); 0 = none, the paper's form.
    Must be below cap."""
    level: str = "token"
    """'token', 'sequence' or 'geometric' (see the module docstring)."""
    batch_normalize: bool = False
    """Divide the weights by their batch mean so it is 1 (verl's
    rollout_is_batch_normalize): at level 'token' the mean over the counted tokens, at
    'sequence' / 'geometric' the mean of the sequences' weights (see normalize_weights)."""

    @property
    def reweights(self) -> bool:
        return True

    def validate(self, key: str) -> None:
        at_least(f"{key}.cap", self.cap, 0.0, strict=True)
        at_least(f"{key}.low", self.low, 0.0)
        if self.low >= self.cap:
            raise ValueError(f"{key}.low={self.low!r} must be < {key}.cap={self.cap!r}")
        one_of(f"{key}.level", self.level, LEVELS)


@dataclass
class MISConfig(CorrectionConfig):
    """Masked IS: tokens whose ratio lies outside [low, high] are dropped (weight 0)."""

    name: str = "mis"
    """Registered name of this correction."""
    low: float = 0.5
    """Smallest ratio kept (inclusive); 0 = no lower bound."""
    high: float = 2.0
    """Largest ratio kept (inclusive)."""
    level: str = "token"
    """'token', 'sequence' (drops whole sequences) or 'geometric' (Geo-Mask)."""
    reweight: bool = True
    """Kept tokens are weighted by their ratio (MIS, IcePop); false = weight 1, a pure
    rejection mask."""
    batch_normalize: bool = False
    """Divide the weights by their batch mean so it is 1 (verl's
    rollout_is_batch_normalize): at level 'token' the mean over the counted tokens, at
    'sequence' / 'geometric' the mean of the sequences' weights (see normalize_weights)."""

    @property
    def reweights(self) -> bool:
        return self.reweight

    def validate(self, key: str) -> None:
        at_least(f"{key}.low", self.low, 0.0)
        at_least(f"{key}.high", self.high, self.low, strict=True)
        one_of(f"{key}.level", self.level, LEVELS)
        if self.batch_normalize and not self.reweight:
            raise ValueError(
                f"{key}.batch_normalize=true needs {key}.reweight=true: a pure rejection mask "
                "has no IS weights to normalise"
            )


@dataclass
class IcePopConfig(MISConfig):
    """IcePop (Ring-1T): masked IS at token level with the acceptance band [0.5, 5]."""

    name: str = "icepop"
    """Registered name of this correction."""
    low: float = 0.5
    """Smallest ratio kept (IcePop's alpha)."""
    high: float = 5.0
    """Largest ratio kept (IcePop's beta)."""
    level: str = "token"
    """IcePop masks single tokens; 'sequence' and 'geometric' are allowed as for mis."""
    reweight: bool = True
    """IcePop weights kept tokens by their ratio (its M(k) = k inside the band)."""


@dataclass
class TOPRConfig(CorrectionConfig):
    """Tapered Off-Policy REINFORCE (Le Roux et al. 2025): weight 1 for tokens with
    advantage >= 0, min(ratio, 1) for negative advantages. Pair with `algo/loss=reinforce`;
    needs CorrectionInput.advantages_T."""

    name: str = "topr"
    """Registered name of this correction."""
    level: str = "sequence"
    """The paper truncates the trajectory ratio ('sequence'); 'token' and 'geometric' are
    variants."""

    @property
    def reweights(self) -> bool:
        return True

    def validate(self, key: str) -> None:
        one_of(f"{key}.level", self.level, LEVELS)


@dataclass
class VersionGapConfig(CorrectionConfig):
    """Drop tokens sampled by a policy more than `max_gap` versions behind the trainer."""

    name: str = "version_gap"
    """Registered name of this correction."""
    max_gap: int = 1
    """Largest accepted current_version - token version; 0 = strictly on-policy."""
    level: str = "token"
    """'token' drops the stale tokens only; 'sequence' drops every sequence holding one
    (a partial rollout that spans weight updates)."""

    @property
    def reweights(self) -> bool:
        return False

    def validate(self, key: str) -> None:
        at_least(f"{key}.max_gap", self.max_gap, 0)
        one_of(f"{key}.level", self.level, ("token", "sequence"))


@dataclass
class OPSMConfig(CorrectionConfig):
    """Off-policy sequence masking (DeepSeek-V3.2, arXiv 2512.02556, §3.1): drop every
    token with a negative advantage whose sequence's mean log(rollout / trainer) exceeds
    delta; weight 1 elsewhere. Needs CorrectionInput.advantages_T."""

    name: str = "opsm"
    """Registered name of this correction."""
    delta: float = 1.0e-4
    """Threshold δ on the sequence's KL estimate mean_t log(μ_t / π_t). The paper leaves it
    a hyper-parameter; 1e-4 is slime's --opsm-delta default (Trinity-RFT uses 0.1)."""

    @property
    def reweights(self) -> bool:
        return False

    def validate(self, key: str) -> None:
        at_least(f"{key}.delta", self.delta, 0.0)


@dataclass
class CustomCorrectionConfig(CorrectionConfig):
    """A correction outside moerl: `fn(CorrectionInput, **options) -> CorrectionOutput`."""

    name: str = "custom"
    """Marks the escape hatch; the function is found through `_target_`."""
    _target_: str = ""
    """Import path of the function, e.g. 'mylab.corrections.my_is'."""
    options: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments passed to the function (`+correction.options.cap=3`)."""
    reweights: bool = True
    """Declare whether the function's weights can differ from 1 on kept tokens (an IS
    weight); false if it only masks. moerl cannot see inside the function, and the
    trainer's start-up check reads this (`correction.reweights=false`)."""
    batch_statistic: bool = True
    """Declare whether a token's weight depends on other sequences of the batch (a batch
    mean, a quantile); false lets the trainer take π_old from the training forward, one
    micro-batch at a time, and skip the separate old-policy forward
    (`correction.batch_statistic=false`)."""


CORRECTION_OPTIONS: dict[str, type[CorrectionConfig]] = {
    "none": CorrectionConfig,
    "tis": TISConfig,
    "mis": MISConfig,
    "icepop": IcePopConfig,
    "topr": TOPRConfig,
    "version_gap": VersionGapConfig,
    "opsm": OPSMConfig,
    "custom": CustomCorrectionConfig,
}
