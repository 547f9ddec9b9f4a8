"""Advantage estimators against hand-computed references.

The shared batch: six sequences in three groups, with non-contiguous group ids.

    rewards   [1,   0,   0,   0.5, 0.5, 2]
    group     [7,   7,   7,   3,   3,   9]

Group 7: mean 1/3, deviations [2/3, -1/3, -1/3], squared sum 6/9, Bessel variance
(6/9)/2 = 1/3, std 1/sqrt(3). Group 3: equal rewards. Group 9: a single sequence.
"""

from __future__ import annotations

import math

import pytest
import torch

from moerl.algo.advantages import (
    ADVANTAGES,
    AdvantageInput,
    build_advantage,
    dr_grpo,
    grpo,
    reinforce_pp,
    reinforce_pp_baseline,
    rloo,
)
from moerl.algo.config import GRPOConfig, ReinforcePPBaselineConfig, ReinforcePPConfig

REWARDS = [1.0, 0.0, 0.0, 0.5, 0.5, 2.0]
GROUPS = [7, 7, 7, 3, 3, 9]


def _inp(rewards=REWARDS, groups=GROUPS) -> AdvantageInput:
    return AdvantageInput(
        rewards_S=torch.tensor(rewards, dtype=torch.float64),
        group_ids_S=torch.tensor(groups, dtype=torch.int64),
    )


def _close(actual: torch.Tensor, expected: list[float], tol: float = 1e-6) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=tol, rtol=0)


def test_grpo_hand_computed() -> None:
    # Group 7: deviations / (1/sqrt 3) = [2/sqrt3, -1/sqrt3, -1/sqrt3]; eps=1e-6 shifts the
    # 6th decimal at most. Equal group and single group: 0.
    out = grpo(_inp(), GRPOConfig())
    s3 = math.sqrt(3.0)
    _close(out.advantages_S, [2 / s3, -1 / s3, -1 / s3, 0.0, 0.0, 0.0], tol=1e-5)
    # Two of three groups (3 and 9) have no reward spread.
    assert out.metrics["adv/zero_std_group_frac"] == pytest.approx(2 / 3)
    # Batch mean reward: 4 / 6.
    assert out.metrics["reward/mean"] == pytest.approx(2 / 3)
    assert not out.advantages_S.requires_grad


def test_grpo_without_std_is_dr_grpo() -> None:
    # Mean baseline only: [1 - 1/3, -1/3, -1/3, 0, 0, 0].
    expected = [2 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.0]
    _close(grpo(_inp(), GRPOConfig(std_normalize=False)).advantages_S, expected)
    _close(dr_grpo(_inp(), ADVANTAGES.config_type("dr_grpo")()).advantages_S, expected)


def test_rloo_hand_computed() -> None:
    # Group 7: 1 - (0+0)/2 = 1; 0 - (1+0)/2 = -0.5 twice. Group 3: 0.5 - 0.5 = 0.
    # Group 9 has no other member: 0 by definition.
    out = rloo(_inp(), ADVANTAGES.config_type("rloo")())
    _close(out.advantages_S, [1.0, -0.5, -0.5, 0.0, 0.0, 0.0])


def test_reinforce_pp_hand_computed() -> None:
    # Batch mean 4/6 = 2/3; deviations [1/3, -2/3, -2/3, -1/6, -1/6, 4/3];
    # squares in 36ths: 4 + 16 + 16 + 1 + 1 + 64 = 102 → 17/6; Bessel variance 17/30.
    std = math.sqrt(17 / 30)
    dev = [1 / 3, -2 / 3, -2 / 3, -1 / 6, -1 / 6, 4 / 3]
    out = reinforce_pp(_inp(), ReinforcePPConfig())
    _close(out.advantages_S, [d / std for d in dev], tol=1e-5)


def test_reinforce_pp_baseline_hand_computed() -> None:
    # Group-centred: [2/3, -1/3, -1/3, 0, 0, 0], batch mean 0, squared sum 6/9,
    # Bessel variance (2/3)/5 = 2/15.
    std = math.sqrt(2 / 15)
    out = reinforce_pp_baseline(_inp(), ReinforcePPBaselineConfig())
    _close(out.advantages_S, [2 / 3 / std, -1 / 3 / std, -1 / 3 / std, 0.0, 0.0, 0.0], tol=1e-5)


@pytest.mark.parametrize("name", sorted(ADVANTAGES.names()))
def test_all_equal_rewards_give_exact_zero(name: str) -> None:
    # 0.1 is not representable: a computed mean differs from 0.1 by rounding, and
    # rounding / (tiny std + eps) would not be 0. Every estimator must return exact zeros.
    out = build_advantage(name)(_inp([0.1, 0.1, 0.1, 0.1], [0, 0, 1, 1]))
    assert torch.equal(out.advantages_S, torch.zeros(4, dtype=torch.float64))
    assert out.metrics["adv/zero_std_group_frac"] == 1.0


@pytest.mark.parametrize("name", sorted(ADVANTAGES.names()))
def test_single_sequence_groups_are_finite(name: str) -> None:
    # Groups of one: no baseline from others, no std. Group estimators give 0; the
    # batch-normalised ones see the spread across groups.
    out = build_advantage(name)(_inp([1.0, 0.0, 3.0], [0, 1, 2]))
    assert torch.isfinite(out.advantages_S).all()
    if name in ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"):
        assert torch.equal(out.advantages_S, torch.zeros(3, dtype=torch.float64))
    else:
        # mean 4/3, deviations [-1/3, -4/3, 5/3], squares 1/9+16/9+25/9 = 42/9,
        # Bessel variance 42/18 = 7/3.
        std = math.sqrt(7 / 3)
        _close(out.advantages_S, [-1 / 3 / std, -4 / 3 / std, 5 / 3 / std], tol=1e-5)


def test_integer_rewards_are_promoted() -> None:
    inp = AdvantageInput(torch.tensor([1, 0]), torch.tensor([0, 0]))
    # Mean 1/2, deviations ±1/2 → dr_grpo [0.5, -0.5] in float.
    _close(build_advantage("dr_grpo")(inp).advantages_S, [0.5, -0.5])


def test_empty_batch() -> None:
    for name in ADVANTAGES.names():
        out = build_advantage(name)(_inp([], []))
        assert out.advantages_S.shape == (0,)


def test_shape_mismatch_is_rejected() -> None:
    with pytest.raises(ValueError, match="same length"):
        AdvantageInput(torch.zeros(3), torch.zeros(2, dtype=torch.int64))


def test_options_reach_the_function() -> None:
    # Built from a mapping with an option: std_normalize off gives the Dr. GRPO numbers.
    fn = build_advantage({"name": "grpo", "std_normalize": False})
    _close(fn(_inp()).advantages_S, [2 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="algo.advantage.eps=0.0 must be > 0.0"):
        build_advantage(GRPOConfig(eps=0.0))
