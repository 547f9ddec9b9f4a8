"""Process rewards: steps cut from a response, PRM inputs, and per-step scores turned into
per-token advantages through algo.credit=turn, checked against numbers worked by hand."""

from __future__ import annotations

import numpy as np
import pytest

from moerl.algo.advantages import build_advantage
from moerl.algo.config import GRPOConfig
from moerl.algo.credit import assign_credit
from moerl.common.trajectory import Trajectory
from moerl.rollout.process_reward import (
    apply_step_rewards,
    build_step_parser,
    check_ends,
    delimiter_parser,
    prm_input,
)


def _traj(index: int, response: list[int], reward: float) -> Trajectory:
    R = len(response)
    return Trajectory(
        prompt_ids=[1, 2], response_ids=response, response_logprobs=np.zeros(R),
        versions=np.zeros(R), reward=reward, group_id=0, index=index,
    )  # fmt: skip


def test_delimiter_parser_ends_steps_after_the_delimiter_token():
    parse = delimiter_parser(",")
    assert parse(list("12,34,5")) == [3, 6, 7]
    assert parse(list("12,34,")) == [3, 6]  # the last step ends with its delimiter
    assert parse(list("12345")) == [5]  # no delimiter: one step
    assert build_step_parser(",", "") is not None
    with pytest.raises(ValueError, match="reward_model.step_parser"):
        build_step_parser(",", "no.such.module.fn")


def test_check_ends_rejects_steps_that_do_not_tile_the_response():
    assert check_ends([2, 5], 5) == [2, 5]
    for bad in ([2, 4], [0, 5], [3, 3, 5], []):
        with pytest.raises(ValueError, match="step ends"):
            check_ends(bad, 5)


def test_prm_input_appends_the_tag_after_every_step():
    ids, tags = prm_input(np.array([7, 8]), np.array([1, 2, 3, 4, 5]), [2, 5], tag_id=99)
    assert ids == [7, 8, 1, 2, 99, 3, 4, 5, 99]
    assert tags == [4, 8]
    assert [ids[t] for t in tags] == [99, 99]


def test_step_scores_become_segments_with_the_outcome_on_the_last_step():
    t = _traj(0, [1, 2, 3, 4, 5], reward=1.0)
    apply_step_rewards(t, [2, 5], [0.5, 1.0], weight=1.0)
    assert [(s.start, s.end, s.source, s.turn, s.reward) for s in t.segments] == [
        (0, 2, "policy", 0, 0.5),
        (2, 5, "policy", 1, 2.0),  # 1.0 (score) + 1.0 (outcome)
    ]
    assert t.reward == 2.5  # the total, what credit=outcome trains with
    t.validate()


@pytest.mark.parametrize(
    "discount, adv_a, adv_b",
    [
        # G_a = [0.5 + 2.0, 2.0] = [2.5, 2.0], G_b = [0.0 + 0.5, 0.5]; mean 1.375
        (1.0, [1.125] * 2 + [0.625] * 3, [-0.875] * 5),
        # G_a = [0.5 + 0.5 * 2.0, 2.0] = [1.5, 2.0], G_b = [0.25, 0.5]; mean 1.0625
        (0.5, [0.4375] * 2 + [0.9375] * 3, [-0.8125] * 3 + [-0.5625] * 2),
    ],
)
def test_per_step_scores_give_per_token_advantages_by_hand(discount, adv_a, adv_b):
    a = _traj(0, [1, 2, 3, 4, 5], reward=1.0)  # steps [0, 2) [2, 5), scores 0.5 1.0
    b = _traj(1, [6, 7, 8, 9, 10], reward=0.0)  # steps [0, 3) [3, 5), scores 0.0 0.5
    apply_step_rewards(a, [2, 5], [0.5, 1.0], weight=1.0)
    apply_step_rewards(b, [3, 5], [0.0, 0.5], weight=1.0)
    grpo = build_advantage(GRPOConfig(std_normalize=False))
    credit = assign_credit([a, b], grpo, credit="turn", discount=discount)
    np.testing.assert_allclose(credit.advantages[0], adv_a, rtol=1e-6)
    np.testing.assert_allclose(credit.advantages[1], adv_b, rtol=1e-6)
    # credit=outcome sees one sample per trajectory, its total: 2.5 and 0.5
    outcome = assign_credit([a, b], grpo)
    assert outcome.advantages == pytest.approx([1.0, -1.0])


def test_weight_scales_scores_and_episodes_keep_their_turns():
    t = _traj(0, [1, 2, 3], reward=0.0)
    apply_step_rewards(t, [1, 3], [1.0, 0.5], weight=0.1)
    assert [s.reward for s in t.segments] == pytest.approx([0.1, 0.05])
    before = list(t.segments)
    apply_step_rewards(t, [3], [1.0], weight=1.0)  # segments already there: unchanged
    assert t.segments == before
