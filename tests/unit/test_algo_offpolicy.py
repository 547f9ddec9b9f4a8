"""How the old policy, the behaviour policy and the IS correction compose into the policy
loss (moerl.algo.offpolicy), checked by hand in fp64.

The tokens of the first optimizer step of a batch: π_θ = π_old in value, μ differs from
both (mismatch and staleness). With d = log π_old − log μ, truncated IS (Yao et al. 2025)
asks for the per-token gradient -min(e^d, C)·A·∇log π / T under token_mean.
"""

from __future__ import annotations

import math

import pytest
import torch

from moerl.algo.check import check_algo_config
from moerl.algo.config import (
    AlgoConfig,
    PPOClipConfig,
    ReinforceConfig,
)
from moerl.algo.correction import CorrectionInput, build_correction
from moerl.algo.correction_config import CorrectionConfig, MISConfig, TISConfig
from moerl.algo.losses import build_policy_loss
from moerl.algo.offpolicy import check_composition, loss_input

CAP = 2.0
D = [0.5, -0.15, 1.2, 0.0]  # log π_old − log μ per token
ADV = [1.0, -2.0, 0.5, 3.0]
OLD = [-1.0, -0.7, -2.2, -0.4]  # log π_old


def _grad(old_policy: str, loss: str, weights_from: str | None, decoupled: bool = False):
    """Per-token gradient of the loss w.r.t. log π_θ at π_θ = π_old."""
    old_T = torch.tensor(OLD, dtype=torch.float64)
    mu_T = old_T - torch.tensor(D, dtype=torch.float64)
    lp_T = old_T.clone().requires_grad_(True)
    T = len(OLD)
    common = dict(
        loss_mask_T=torch.ones(T, dtype=torch.bool), seq_ids_T=torch.arange(T), num_seqs=T
    )
    weights_T = None
    if weights_from is not None:  # the correction sees π_old (recompute) or π_θ (old code)
        trainer_T = old_T if weights_from == "old" else lp_T.detach()
        corr = build_correction(TISConfig(cap=CAP))(
            CorrectionInput(trainer_logprobs_T=trainer_T, rollout_logprobs_T=mu_T, **common)
        )
        weights_T = corr.weights_T
    inp = loss_input(
        old_policy=old_policy, decoupled=decoupled, logprobs_T=lp_T, behaviour_logprobs_T=mu_T,
        old_logprobs_T=old_T, weights_T=weights_T,
        advantages_T=torch.tensor(ADV, dtype=torch.float64), **common,
    )  # fmt: skip
    spec = PPOClipConfig(decoupled=decoupled) if loss == "ppo_clip" else loss
    build_policy_loss(spec)(inp).loss.backward()
    return lp_T.grad.tolist()


def test_recompute_ppo_clip_with_tis_has_the_truncated_weight():
    want = [-min(math.exp(d), CAP) * a / len(D) for d, a in zip(D, ADV)]
    assert _grad("recompute", "ppo_clip", "old") == pytest.approx(want, abs=1e-12)


def test_the_former_composition_weighted_twice():
    """Ratio against μ and the correction on top (what the trainer did before): the
    gradient carries r·min(r, C), or nothing where PPO clips r = e^d."""
    got = _grad("rollout", "ppo_clip", "theta")
    want = [-min(math.exp(d), CAP) * a / len(D) for d, a in zip(D, ADV)]
    assert got != pytest.approx(want, abs=1e-6)
    # token 1: r = e^-0.15 inside the trust region for A < 0 → -r·min(r, C)·A / T
    r = math.exp(D[1])
    assert got[1] == pytest.approx(-r * r * ADV[1] / len(D), abs=1e-12)


def test_decoupled_ppo_is_recompute_with_an_uncapped_weight():
    """AReaL's decoupled PPO = recompute mode with weight π_old/μ inside the loss."""
    want = [-math.exp(d) * a / len(D) for d, a in zip(D, ADV)]
    assert _grad("recompute", "ppo_clip", None, decoupled=True) == pytest.approx(want, abs=1e-12)


def test_bypass_reinforce_takes_the_weight():
    """Bypass with a loss without a ratio: REINFORCE + TIS (the weight min(π/μ, C))."""
    want = [-min(math.exp(d), CAP) * a / len(D) for d, a in zip(D, ADV)]
    assert _grad("rollout", "reinforce", "theta") == pytest.approx(want, abs=1e-12)


def test_bypass_ratio_is_against_the_behaviour_policy():
    """Bypass, no correction: PPO's ratio is π_θ/μ = e^d (clipped where it leaves the
    trust region on the advantage's side: tokens 0 and 2 with A > 0 and e^d > 1.2)."""
    got = _grad("rollout", "ppo_clip", None)
    want = [
        0.0 if (a > 0 and math.exp(d) > 1.2) or (a < 0 and math.exp(d) < 0.8)
        else -math.exp(d) * a / len(D)
        for d, a in zip(D, ADV)
    ]  # fmt: skip
    assert got == pytest.approx(want, abs=1e-12)


def test_recompute_needs_old_logprobs():
    with pytest.raises(ValueError, match="old_policy=recompute needs"):
        loss_input(
            old_policy="recompute", decoupled=False, logprobs_T=torch.zeros(1),
            behaviour_logprobs_T=torch.zeros(1), old_logprobs_T=None, weights_T=None,
            advantages_T=torch.zeros(1), loss_mask_T=torch.ones(1, dtype=torch.bool),
            seq_ids_T=torch.zeros(1, dtype=torch.long), num_seqs=1,
        )  # fmt: skip


@pytest.mark.parametrize(
    ("old_policy", "loss", "correction", "error"),
    [
        ("rollout", PPOClipConfig(), TISConfig(), "weights each token twice"),
        ("rollout", PPOClipConfig(), MISConfig(), "weights each token twice"),
        ("recompute", PPOClipConfig(decoupled=True), TISConfig(), "weight it again"),
        ("rollout", PPOClipConfig(decoupled=True), CorrectionConfig(), "needs the trainer"),
        ("sometimes", PPOClipConfig(), TISConfig(), "algo.old_policy='sometimes'"),
    ],
)
def test_double_counting_is_refused(old_policy, loss, correction, error):
    with pytest.raises(ValueError, match=error):
        check_composition(old_policy, loss, correction)
    with pytest.raises(ValueError, match=error):  # the start-up check runs it
        check_algo_config(AlgoConfig(loss=loss, old_policy=old_policy), correction)


@pytest.mark.parametrize(
    ("old_policy", "loss", "correction"),
    [
        ("recompute", PPOClipConfig(), TISConfig()),
        ("recompute", PPOClipConfig(decoupled=True), CorrectionConfig()),
        ("recompute", PPOClipConfig(decoupled=True), MISConfig(reweight=False)),
        ("rollout", PPOClipConfig(), MISConfig(reweight=False)),
        ("rollout", PPOClipConfig(), CorrectionConfig()),
        ("rollout", ReinforceConfig(), TISConfig()),
    ],
)
def test_valid_compositions_pass(old_policy, loss, correction):
    check_composition(old_policy, loss, correction)
