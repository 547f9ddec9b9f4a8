"""How the behaviour policy, the trainer's old policy and the IS correction compose into
one policy loss (`algo.old_policy`).

# T tokens in the batch, S sequences

Three policies score each trained token:

    μ       the behaviour policy: the engine's logprob when it sampled the token
            (over the sampling mask's kept set when one was recorded)
    π_old   the trainer's weights at the start of the rollout batch, recomputed on the
            batch with the same Keep Routing replay and sampling mask (no grad)
    π_θ     the weights being optimised

| algo.old_policy | ratio losses (ppo_clip, gspo, cispo, sapo, gmpo) | the correction | losses without a ratio (reinforce) |
|---|---|---|---|
| `recompute` | r = π_θ / π_old | weights and masks from π_old / μ | weighted by the correction |
| `rollout` (bypass) | r = π_θ / μ | may only mask (its ratio is π_old / μ) | weighted by the correction |

`recompute` is the form of Yao et al. 2025 ("Your efficient RL framework secretly brings
you off-policy RL training", truncated IS) and of verl's rollout correction: the trust
region is centred on the trainer's own policy, and the engine/trainer gap (mismatch and
staleness) is corrected once, by the weight π_old / μ. In `rollout` the ratio π_θ / μ
already *is* the importance weight; multiplying a reweighting correction onto it would
weight each token by r · w(r), counting the gap twice (the bug this module replaced), so
validation refuses that combination. Masks (MIS rejection, IcePop with reweight=false,
OPSM, version_gap) still apply. AReaL's decoupled PPO (`algo.loss.decoupled=true`) is the
`recompute` form with the behaviour weight inside the loss: it takes μ as the old policy
and π_old as the proximal one, and a reweighting correction would again count twice.

With `trainer.minibatches > 1` π_old stays the weights at the start of the batch for every
minibatch, so later minibatches' ratios measure how far the update has moved.
"""

from __future__ import annotations

from typing import Any

import torch

from moerl.algo.losses import PolicyLossInput
from moerl.common.checks import one_of

OLD_POLICIES = ("recompute", "rollout")


def _name(cfg: Any) -> str:
    return str(getattr(cfg, "_target_", "") or getattr(cfg, "name", "?"))


def check_composition(old_policy: str, loss: Any, correction: Any) -> None:
    """Refuse, with the fixes, a loss/correction pair that weights the gap twice."""
    one_of("algo.old_policy", old_policy, OLD_POLICIES)
    reweights = bool(getattr(correction, "reweights", False))
    if getattr(loss, "decoupled", False):
        if old_policy != "recompute":
            raise ValueError(
                "algo.loss.decoupled=true needs the trainer's old policy as its proximal "
                "policy: set algo.old_policy=recompute, or algo.loss.decoupled=false"
            )
        if reweights:
            raise ValueError(
                f"algo.loss.decoupled=true already weights each token by π_old/μ; "
                f"correction={_name(correction)} would weight it again (double importance "
                "weighting). Fix: correction=none (or a masking correction such as "
                "correction=mis correction.reweight=false), or algo.loss.decoupled=false "
                "with the correction"
            )
    if old_policy == "rollout" and getattr(loss, "ratio_loss", True) and reweights:
        raise ValueError(
            f"algo.old_policy=rollout with algo.loss={_name(loss)} and "
            f"correction={_name(correction)} weights each token twice: the loss's ratio "
            "π_θ/μ already is the importance weight and the correction multiplies its own "
            "on top. Fix: algo.old_policy=recompute (the ratio is taken against the "
            "trainer's old policy and the correction weights π_old/μ), or a correction "
            "that only masks (correction=none, correction=opsm, correction=version_gap, "
            "correction=mis correction.reweight=false)"
        )


def needs_old_policy(old_policy: str, correction: Any) -> bool:
    """Whether the step needs π_old before its update: always in `recompute`; in `rollout`
    when a correction (other than `none`) reads the trainer's logprobs for its masks."""
    return old_policy == "recompute" or getattr(correction, "name", "none") != "none"


def loss_input(
    *,
    old_policy: str,
    decoupled: bool,
    logprobs_T: torch.Tensor,
    behaviour_logprobs_T: torch.Tensor,
    old_logprobs_T: torch.Tensor | None,
    weights_T: torch.Tensor | None,
    advantages_T: torch.Tensor,
    loss_mask_T: torch.Tensor,
    seq_ids_T: torch.Tensor,
    num_seqs: int,
) -> PolicyLossInput:
    """The policy loss's input under `old_policy` (see the module's table).

    ``behaviour_logprobs_T`` is μ, ``old_logprobs_T`` π_old (needed by `recompute`),
    ``weights_T`` the correction's per-token weights (0 = dropped; None = no correction).
    """
    if old_policy == "rollout":
        anchor_T, proximal_T = behaviour_logprobs_T, None
    elif old_policy == "recompute":
        if old_logprobs_T is None:
            raise ValueError(
                "algo.old_policy=recompute needs the trainer's old-policy logprobs of the "
                "batch (computed before the update); none were given"
            )
        anchor_T, proximal_T = old_logprobs_T, None
        if decoupled:  # AReaL: behaviour μ as old, π_old as proximal
            anchor_T, proximal_T = behaviour_logprobs_T, old_logprobs_T
    else:
        one_of("algo.old_policy", old_policy, OLD_POLICIES)
    return PolicyLossInput(
        logprobs_T=logprobs_T,
        old_logprobs_T=anchor_T.detach(),
        advantages_T=advantages_T,
        loss_mask_T=loss_mask_T,
        seq_ids_T=seq_ids_T,
        num_seqs=num_seqs,
        is_weights_T=weights_T,
        proximal_logprobs_T=None if proximal_T is None else proximal_T.detach(),
    )
