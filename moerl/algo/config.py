"""Options of the algorithm slots: advantage estimator, policy loss and KL term (group `algo`).

One dataclass per built-in, each a subclass of its slot's base (`AdvantageConfig`,
`PolicyLossConfig`) so that Hydra can merge any option into the slot. The Hydra groups:

    algo             AlgoConfig: advantage + loss + kl, conf/algo/*.yaml (`algo=dapo`)
    algo/advantage   one schema per estimator, conf/algo/advantage/ (`algo/advantage=rloo`)
    algo/loss        one schema per policy loss, conf/algo/loss/ (`algo/loss=gspo`)

The IS corrections (group `correction`) are in `correction_config.py`. These modules import
no torch, so `moerl.config` stays cheap to import; the functions they configure live in
`advantages.py`, `losses.py` and `kl.py`, registered under the same names.

Every slot has a `custom` option: `_target_` is the import path of a function outside moerl
and `options` its keyword arguments (`algo/loss=custom algo.loss._target_=mylab.losses.f`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from moerl.common.checks import at_least, one_of

if TYPE_CHECKING:
    from hydra.core.config_store import ConfigStore

AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")
KL_KINDS = ("k1", "k2", "k3")


def check_agg(key: str, agg: str, norm_length: int) -> None:
    """`key.agg` is one of AGG_MODES; the constant-length mode needs `key.norm_length`."""
    one_of(f"{key}.agg", agg, AGG_MODES)
    if agg == "seq_mean_token_sum_norm" and norm_length <= 0:
        raise ValueError(
            f"{key}.norm_length={norm_length!r} must be > 0 with "
            f"{key}.agg='seq_mean_token_sum_norm': it is Dr. GRPO's constant length L_max; "
            f"set it to rollout.max_new_tokens"
        )


# --- advantage estimators ---------------------------------------------------------


@dataclass
class AdvantageConfig:
    """The advantage slot. A bare AdvantageConfig means its `name` with default options."""

    name: str = "grpo"
    """Estimator registered in moerl.algo.advantages.ADVANTAGES; pick one with
    `algo/advantage=NAME`."""

    def validate(self, key: str) -> None:
        """Raise ValueError naming `key.field` for an out-of-range option."""


@dataclass
class GRPOConfig(AdvantageConfig):
    """GRPO: A = (r - mean of the group) / (std of the group + eps)."""

    name: str = "grpo"
    """Registered name of this estimator."""
    std_normalize: bool = True
    """Divide by the group's reward std (Bessel-corrected; 0 for a group of one). False
    gives the plain mean baseline, i.e. `dr_grpo`."""
    eps: float = 1.0e-6
    """Added to the std so that a group of equal rewards gets advantage 0, not 0/0."""

    def validate(self, key: str) -> None:
        at_least(f"{key}.eps", self.eps, 0.0, strict=True)


@dataclass
class DrGRPOConfig(AdvantageConfig):
    """Dr. GRPO: A = r - mean of the group, no std normalisation (Liu et al. 2025)."""

    name: str = "dr_grpo"
    """Registered name of this estimator."""


@dataclass
class RLOOConfig(AdvantageConfig):
    """RLOO: A_i = r_i - mean of the other members of i's group; 0 for a group of one."""

    name: str = "rloo"
    """Registered name of this estimator."""


@dataclass
class ReinforcePPConfig(AdvantageConfig):
    """REINFORCE++: A = (r - batch mean) / (batch std + eps), no group baseline."""

    name: str = "reinforce_pp"
    """Registered name of this estimator."""
    eps: float = 1.0e-6
    """Added to the batch std (Bessel-corrected; 0 for a batch of one)."""

    def validate(self, key: str) -> None:
        at_least(f"{key}.eps", self.eps, 0.0, strict=True)


@dataclass
class ReinforcePPBaselineConfig(AdvantageConfig):
    """REINFORCE++ with baseline: subtract the group mean, then normalise over the batch."""

    name: str = "reinforce_pp_baseline"
    """Registered name of this estimator."""
    eps: float = 1.0e-6
    """Added to the batch std of the group-centred rewards."""

    def validate(self, key: str) -> None:
        at_least(f"{key}.eps", self.eps, 0.0, strict=True)


@dataclass
class CustomAdvantageConfig(AdvantageConfig):
    """An estimator outside moerl: `fn(AdvantageInput, **options) -> AdvantageOutput`."""

    name: str = "custom"
    """Marks the escape hatch; the function is found through `_target_`."""
    _target_: str = ""
    """Import path of the function, e.g. 'mylab.advantages.my_estimator'."""
    options: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments passed to the function (`+algo.advantage.options.beta=0.5`)."""


# --- policy losses ----------------------------------------------------------------


@dataclass
class PolicyLossConfig:
    """The policy-loss slot. A bare PolicyLossConfig means its `name` with default options."""

    name: str = "ppo_clip"
    """Loss registered in moerl.algo.losses.POLICY_LOSSES; pick one with `algo/loss=NAME`."""

    @property
    def ratio_loss(self) -> bool:
        """True if the loss takes the ratio π_θ / old_logprobs_T (PPO-like), False if it
        only needs π_θ (REINFORCE); the trainer's start-up check reads it. Each option
        overrides it; a bare PolicyLossConfig means its `name` with default options, so it
        answers for that."""
        option = LOSS_OPTIONS.get(self.name)
        if option is None or isinstance(self, option):
            return True
        return option().ratio_loss

    def validate(self, key: str) -> None:
        """Raise ValueError naming `key.field` for an out-of-range option."""


@dataclass
class PPOClipConfig(PolicyLossConfig):
    """PPO's clipped surrogate, with clip-higher, dual clip and AReaL's decoupled form."""

    name: str = "ppo_clip"
    """Registered name of this loss."""
    eps_low: float = 0.2
    """The ratio is clipped below at 1 - eps_low (binds for negative advantages)."""
    eps_high: float = 0.2
    """The ratio is clipped above at 1 + eps_high (binds for positive advantages);
    eps_high > eps_low is DAPO's clip-higher."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 (Ye et al. 2020): for a negative advantage the per-token loss
    is at most -c·A, so a huge ratio cannot blow it up. None = off."""
    agg: str = "token_mean"
    """How per-token losses become one number: 'token_mean' (over all counted tokens of
    the batch), 'seq_mean_token_mean' or 'seq_mean_token_sum' (per sequence, then the mean
    over num_seqs sequences), or 'seq_mean_token_sum_norm' (the sum over all counted tokens
    / (num_seqs · norm_length), Dr. GRPO's constant normaliser); moerl.algo.reduce.aggregate."""
    norm_length: int = 0
    """L_max of 'seq_mean_token_sum_norm' (the generation budget, rollout.max_new_tokens);
    unused by the other modes."""
    decoupled: bool = False
    """AReaL's decoupled PPO: clip the ratio against the proximal policy
    (PolicyLossInput.proximal_logprobs_T) and weight each token by the detached
    behaviour→proximal ratio exp(proximal - old); old_logprobs_T is then the behaviour
    (rollout) policy."""
    decoupled_weight_cap: float | None = None
    """With decoupled: tokens whose behaviour→proximal weight exceeds this are dropped
    (weight 0), as AReaL's behav_imp_weight_cap. None = keep all."""

    @property
    def ratio_loss(self) -> bool:
        return True

    def validate(self, key: str) -> None:
        at_least(f"{key}.eps_low", self.eps_low, 0.0)
        at_least(f"{key}.eps_high", self.eps_high, 0.0)
        if self.dual_clip is not None:
            at_least(f"{key}.dual_clip", self.dual_clip, 1.0, strict=True)
        if self.decoupled_weight_cap is not None:
            at_least(f"{key}.decoupled_weight_cap", self.decoupled_weight_cap, 0.0, strict=True)
        check_agg(key, self.agg, self.norm_length)


@dataclass
class GSPOConfig(PolicyLossConfig):
    """GSPO (Zheng et al. 2025): one ratio per sequence, exp(mean token log ratio), clipped."""

    name: str = "gspo"
    """Registered name of this loss."""
    eps_low: float = 3.0e-4
    """The sequence ratio is clipped below at 1 - eps_low (the paper's 3e-4)."""
    eps_high: float = 4.0e-4
    """The sequence ratio is clipped above at 1 + eps_high (the paper's 4e-4)."""
    agg: str = "seq_mean_token_mean"
    """Aggregation (see PPOClipConfig.agg); the paper's objective is 'seq_mean_token_mean'."""
    norm_length: int = 0
    """L_max of 'seq_mean_token_sum_norm' (the generation budget, rollout.max_new_tokens);
    unused by the other modes."""

    @property
    def ratio_loss(self) -> bool:
        return True

    def validate(self, key: str) -> None:
        at_least(f"{key}.eps_low", self.eps_low, 0.0)
        at_least(f"{key}.eps_high", self.eps_high, 0.0)
        check_agg(key, self.agg, self.norm_length)


@dataclass
class CISPOConfig(PolicyLossConfig):
    """CISPO (MiniMax-M1): -sg(clip(ratio)) · A · logp; clipped tokens still get gradient."""

    name: str = "cispo"
    """Registered name of this loss."""
    eps_low: float = 1.0
    """The IS weight is clipped below at 1 - eps_low; 1.0 = no lower bound, as the paper."""
    eps_high: float = 0.28
    """The IS weight is clipped above at 1 + eps_high (the only bound the paper tunes)."""
    agg: str = "token_mean"
    """Aggregation (see PPOClipConfig.agg); the paper normalises by all tokens."""
    norm_length: int = 0
    """L_max of 'seq_mean_token_sum_norm' (the generation budget, rollout.max_new_tokens);
    unused by the other modes."""

    @property
    def ratio_loss(self) -> bool:
        return True

    def validate(self, key: str) -> None:
        at_least(f"{key}.eps_low", self.eps_low, 0.0)
        at_least(f"{key}.eps_high", self.eps_high, 0.0)
        check_agg(key, self.agg, self.norm_length)


@dataclass
class ReinforceConfig(PolicyLossConfig):
    """REINFORCE: -A · logp, no ratio (pair with correction=topr for TOPR)."""

    name: str = "reinforce"
    """Registered name of this loss."""
    agg: str = "token_mean"
    """Aggregation (see PPOClipConfig.agg)."""
    norm_length: int = 0
    """L_max of 'seq_mean_token_sum_norm' (the generation budget, rollout.max_new_tokens);
    unused by the other modes."""

    @property
    def ratio_loss(self) -> bool:
        return False

    def validate(self, key: str) -> None:
        check_agg(key, self.agg, self.norm_length)


@dataclass
class SAPOConfig(PolicyLossConfig):
    """SAPO (Gao et al. 2025, Qwen, arXiv 2511.20347): -f(r)·A with the soft gate
    f(r) = σ(τ(r - 1))·4/τ instead of a hard clip; τ = tau_pos for A > 0, tau_neg else."""

    name: str = "sapo"
    """Registered name of this loss."""
    tau_pos: float = 1.0
    """Gate temperature for positive advantages (the paper's 1.0)."""
    tau_neg: float = 1.05
    """Gate temperature for advantages <= 0 (the paper's 1.05); larger than tau_pos so the
    gradient of a negative token fades faster off-policy."""
    agg: str = "seq_mean_token_mean"
    """Aggregation (see PPOClipConfig.agg); the paper's objective is 'seq_mean_token_mean'
    (verl forces it)."""
    norm_length: int = 0
    """L_max of 'seq_mean_token_sum_norm' (see PPOClipConfig.norm_length)."""

    @property
    def ratio_loss(self) -> bool:
        return True

    def validate(self, key: str) -> None:
        at_least(f"{key}.tau_pos", self.tau_pos, 0.0, strict=True)
        at_least(f"{key}.tau_neg", self.tau_neg, 0.0, strict=True)
        check_agg(key, self.agg, self.norm_length)


@dataclass
class GMPOConfig(PolicyLossConfig):
    """GMPO (Zhao et al. 2025, arXiv 2507.20673): the sequence ratio is the geometric mean
    of its token ratios, each clipped in log space on the side its advantage pushes."""

    name: str = "gmpo"
    """Registered name of this loss."""
    clip_low: float = 0.4
    """Token log ratios are clipped below at -clip_low (for A < 0); the paper's range is
    (e^-0.4, e^0.4)."""
    clip_high: float = 0.4
    """Token log ratios are clipped above at +clip_high (for A > 0)."""
    agg: str = "seq_mean_token_mean"
    """Aggregation (see PPOClipConfig.agg); every token carries its sequence's term, so
    'seq_mean_token_mean' is the paper's mean over sequences (and verl's geo_mean)."""
    norm_length: int = 0
    """L_max of 'seq_mean_token_sum_norm' (see PPOClipConfig.norm_length)."""

    @property
    def ratio_loss(self) -> bool:
        return True

    def validate(self, key: str) -> None:
        at_least(f"{key}.clip_low", self.clip_low, 0.0)
        at_least(f"{key}.clip_high", self.clip_high, 0.0)
        check_agg(key, self.agg, self.norm_length)


@dataclass
class CustomPolicyLossConfig(PolicyLossConfig):
    """A loss outside moerl: `fn(PolicyLossInput, **options) -> PolicyLossOutput`."""

    name: str = "custom"
    """Marks the escape hatch; the function is found through `_target_`."""
    _target_: str = ""
    """Import path of the function, e.g. 'mylab.losses.my_loss'."""
    options: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments passed to the function (`+algo.loss.options.tau=0.1`)."""
    ratio_loss: bool = True
    """Declare whether the function takes the ratio π_θ / old_logprobs_T (false if it only
    needs π_θ, as REINFORCE); moerl cannot see inside the function, and the trainer's
    start-up check reads this (`algo.loss.ratio_loss=false`)."""


# --- KL term and the algo group ---------------------------------------------------


@dataclass
class KLConfig:
    """An optional KL(policy || reference) term added to the loss: coef · agg(kl_T)."""

    coef: float = 0.0
    """Weight of the KL term; 0 = off (no reference model is needed)."""
    kind: str = "k3"
    """Per-token estimator (Schulman 2020): 'k1' (log ratio), 'k2' (half squared log
    ratio) or 'k3' ((ref/policy) - 1 - log(ref/policy), unbiased and >= 0)."""
    agg: str = "token_mean"
    """Aggregation of the per-token KL (see PPOClipConfig.agg)."""
    norm_length: int = 0
    """L_max of 'seq_mean_token_sum_norm' (the generation budget, rollout.max_new_tokens);
    unused by the other modes."""
    clamp: float | None = None
    """Clamp each token's estimate to [-clamp, clamp] (verl's low_var_kl uses 10). None = off.
    With importance_sampling the IS-weighted estimate is clamped, as slime."""
    importance_sampling: bool = False
    """DeepSeek-V3.2's unbiased KL estimate: weight each token's estimate by
    π_θ / π_behaviour, the gradient flowing through the weight too (moerl.algo.kl.kl_term);
    needs KLInput.behaviour_logprobs_T. slime's --use-unbiased-kl."""

    def validate(self, key: str) -> None:
        at_least(f"{key}.coef", self.coef, 0.0)
        one_of(f"{key}.kind", self.kind, KL_KINDS)
        check_agg(key, self.agg, self.norm_length)
        if self.clamp is not None:
            at_least(f"{key}.clamp", self.clamp, 0.0, strict=True)


@dataclass
class AlgoConfig:
    """The RL objective: how rewards become advantages and advantages become a loss."""

    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    """Advantage estimator (group `algo/advantage`)."""
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    """Policy loss (group `algo/loss`)."""
    kl: KLConfig = field(default_factory=KLConfig)
    """Optional KL penalty against a reference policy."""
    old_policy: str = "recompute"
    """What ratio losses take their ratio against (moerl/algo/offpolicy.py has the table):
    'recompute' = the trainer's own weights at the start of the batch, recomputed with
    one extra forward (no grad); the correction then weights or masks π_old/μ.
    'rollout' (bypass) = the engine's behaviour logprobs μ, no extra forward; a
    correction may then only mask, since the ratio π_θ/μ is already the IS weight."""
    credit: str = "outcome"
    """How an episode's rewards reach its tokens (moerl/algo/credit.py): 'outcome' = the
    episode's total reward, one advantage for all its trained tokens; 'turn' = each
    action's discounted return from that action on (turn_discount), so an action is
    credited with what followed it, not with what came before."""
    turn_discount: float = 1.0
    """Discount per later action of the 'turn' credit, in [0, 1]."""


ADVANTAGE_OPTIONS: dict[str, type[AdvantageConfig]] = {
    "grpo": GRPOConfig,
    "dr_grpo": DrGRPOConfig,
    "rloo": RLOOConfig,
    "reinforce_pp": ReinforcePPConfig,
    "reinforce_pp_baseline": ReinforcePPBaselineConfig,
    "custom": CustomAdvantageConfig,
}
LOSS_OPTIONS: dict[str, type[PolicyLossConfig]] = {
    "ppo_clip": PPOClipConfig,
    "gspo": GSPOConfig,
    "cispo": CISPOConfig,
    "reinforce": ReinforceConfig,
    "sapo": SAPOConfig,
    "gmpo": GMPOConfig,
    "custom": CustomPolicyLossConfig,
}


def register_algo_configs(cs: ConfigStore) -> None:
    """Store one schema per option (`base_NAME`) in the groups algo/advantage, algo/loss and
    correction; the group bases (`base_algo`, `base_correction`) are stored by
    moerl.config.store with the other groups."""
    from moerl.algo.correction_config import CORRECTION_OPTIONS

    groups: dict[str, dict[str, type]] = {
        "algo/advantage": dict(ADVANTAGE_OPTIONS),
        "algo/loss": dict(LOSS_OPTIONS),
        "correction": dict(CORRECTION_OPTIONS),
    }
    for group, options in groups.items():
        for name, schema in options.items():
            cs.store(group=group, name=f"base_{name}", node=schema, provider="moerl")
