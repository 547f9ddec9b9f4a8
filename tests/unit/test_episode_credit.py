"""The episode record and what the trainer makes of it: validation and serialisation of
loss masks and segments, per-turn and per-role credit, the micro-batch's loss mask and
per-token advantages, and the off-policy correction over trained tokens only
(hand-built episodes, numbers checked by hand)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moerl.algo.advantages import build_advantage
from moerl.algo.config import GRPOConfig
from moerl.algo.correction import build_correction
from moerl.algo.credit import assign_credit, discounted_returns
from moerl.common.trajectory import Segment, Trajectory
from moerl.trainer.batch import build_microbatch
from moerl.trainer.offpolicy import prepare


def episode(
    group: int, role: str | None, turns: list[tuple[int, int, float]], *, reward=None, seed=0
) -> Trajectory:  # type: ignore[no-untyped-def]
    """prompt of 3 tokens; ``turns``: (action tokens, observation tokens after it, reward);
    the last turn's observation is dropped (never processed)."""
    rng = np.random.default_rng(seed)
    segs, mask, pos = [], [], 0
    for k, (n_act, n_obs, r) in enumerate(turns):
        segs.append(Segment(pos, pos + n_act, "policy", k, r))
        mask += [1] * n_act
        pos += n_act
        if k < len(turns) - 1 and n_obs:
            segs.append(Segment(pos, pos + n_obs, "env", k))
            mask += [0] * n_obs
            pos += n_obs
    R = pos
    ids = rng.integers(4, 60, size=R)
    return Trajectory(
        prompt_ids=[1, 5, 6],
        response_ids=ids,
        response_logprobs=np.where(np.array(mask) == 1, -rng.random(R), 0.0),
        versions=np.zeros(R),
        sampling_logprobs=np.where(np.array(mask) == 1, -rng.random(R) * 0.5, 0.0),
        mask_ids=ids,
        mask_offsets=np.arange(R + 1),
        reward=sum(t[2] for t in turns) if reward is None else reward,
        group_id=group,
        loss_mask=mask,
        segments=segs,
        role=role,
    )


def test_episode_record_validates_and_round_trips():
    t = episode(0, "solver", [(2, 3, 0.5), (4, 2, 1.0)])
    t.validate()
    back = Trajectory.from_dict(t.to_dict())
    assert back.segments == t.segments and back.role == "solver"
    assert np.array_equal(back.loss_mask, t.loss_mask) and back.num_trained == 6
    assert back.trained.tolist() == [True, True, False, False, False, True, True, True, True]


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (lambda t: setattr(t, "loss_mask", t.loss_mask[:-1]), "loss_mask has 8 entries"),
        (lambda t: t.loss_mask.__setitem__(2, 1), "loss_mask disagrees with the env segment"),
        (lambda t: setattr(t.segments[1], "start", 3), "segments must tile the response"),
        (lambda t: setattr(t.segments[0], "source", "oracle"), "segment source 'oracle'"),
        (lambda t: t.segments.pop(), "segments end at 5 but the response has 9"),
    ],
)
def test_a_broken_episode_record_is_named(change, problem):  # type: ignore[no-untyped-def]
    t = episode(0, None, [(2, 3, 0.5), (4, 2, 1.0)])
    change(t)
    with pytest.raises(ValueError, match=problem):
        t.validate()


def test_discounted_returns_by_hand():
    assert discounted_returns([0.1, 0.0, 1.0], 0.5) == pytest.approx([0.35, 0.5, 1.0])
    assert discounted_returns([1.0, 2.0], 1.0) == [3.0, 2.0]


def test_roles_are_baselined_apart():
    """GRPO per group and role: the proposers' rewards 0.5, 0.5 give them 0 whatever the
    solvers got; the solvers' 1, 0 are centred on their own mean."""
    grpo = build_advantage(GRPOConfig(std_normalize=False))
    trajs = [
        episode(7, "proposer", [(3, 0, 0.5)]),
        episode(7, "solver", [(2, 0, 1.0)]),
        episode(7, "proposer", [(3, 0, 0.5)]),
        episode(7, "solver", [(2, 0, 0.0)]),
    ]
    credit = assign_credit(trajs, grpo)
    assert credit.advantages == pytest.approx([0.0, 0.5, 0.0, -0.5])
    # mixing roles into one baseline would have given the proposers non-zero advantages
    pooled = assign_credit([*trajs[:1], *trajs[1:2]], grpo)
    assert pooled.advantages == pytest.approx([0.0, 0.0])  # their own groups of one


def test_turn_credit_gives_each_action_its_return():
    """credit=turn, discount 0.5, two episodes of one group: action returns
    A = (0.35, 0.5, 1.0), B = (0.0, 0.0); baseline = their mean 1.85 / 5 = 0.37."""
    grpo = build_advantage(GRPOConfig(std_normalize=False))
    a = episode(1, None, [(2, 1, 0.1), (2, 1, 0.0), (3, 0, 1.0)])
    b = episode(1, None, [(2, 2, 0.0), (1, 0, 0.0)], seed=1)
    credit = assign_credit([a, b], grpo, credit="turn", discount=0.5)
    adv_a, adv_b = credit.advantages
    base = (0.35 + 0.5 + 1.0) / 5
    expect_a = [0.35 - base] * 2 + [0.0] + [0.5 - base] * 2 + [0.0] + [1.0 - base] * 3
    assert adv_a == pytest.approx(np.array(expect_a, dtype=np.float32), abs=1e-6)
    assert adv_b == pytest.approx(np.array([-base] * 2 + [0.0] * 2 + [-base]), abs=1e-6)
    # outcome credit: one number per trajectory, the episode's total
    outcome = assign_credit([a, b], grpo)
    assert outcome.advantages == pytest.approx([1.1 / 2, -1.1 / 2])


def test_microbatch_trains_only_policy_tokens_with_their_advantages():
    t = episode(0, "solver", [(2, 3, 0.5), (4, 2, 1.0)])
    adv = np.arange(t.response_len, dtype=np.float32)
    mb = build_microbatch([t], [0], 16, advantages=[adv], use_mask=True)
    P = t.prompt_len
    want = np.zeros(16, dtype=bool)
    want[P - 1 : P - 1 + t.response_len] = t.trained
    assert mb.loss_mask[0].numpy().tolist() == want.tolist()
    assert mb.response_mask[0, P - 1 : P - 1 + t.response_len].all()
    assert mb.advantages[0, P - 1 : P - 1 + t.response_len].tolist() == adv.tolist()
    with pytest.raises(ValueError, match="expected a number or"):
        build_microbatch([t], [0], 16, advantages=[adv[:-1]])


def test_correction_sees_only_trained_tokens():
    """TIS over an episode: observation tokens (logprob 0 on both sides would count as
    ratio 1) neither enter the correction's statistics nor get a weight other than 1."""
    t = episode(0, None, [(2, 3, 0.5), (4, 2, 1.0)])
    old = t.sampling_logprobs + np.where(t.trained, 0.3, 5.0).astype(np.float32)
    out = prepare(
        [t], [1.0], old_logprobs=[old], correction_fn=build_correction("tis"), use_mask=True,
        current_version=0,
    )  # fmt: skip
    (w,) = out.is_weights
    assert (w[~t.trained] == 1.0).all()
    assert w[t.trained] == pytest.approx(np.full(6, min(np.exp(0.3), 2.0)), rel=1e-5)
    assert out.metrics["mismatch/log_ratio_abs_max"] == pytest.approx(0.3, abs=1e-5)
    assert torch.tensor(out.metrics["mismatch/mean_abs_dlogp"]) == pytest.approx(0.3, abs=1e-5)


def test_staleness_per_turn():
    """Turn 0 sampled by version 3, turn 1 half by 3 and half by 4 (an in-place update),
    trainer at version 5: gaps 2 and 1.5; the last turn's is 1.5."""
    from moerl.trainer.offpolicy import turn_staleness

    t = episode(0, None, [(2, 1, 0.0), (4, 0, 1.0)])
    t.versions[:] = 3
    t.versions[5:] = 4
    assert turn_staleness([t], 5) == {
        "episode/staleness_turn_0": 2.0,
        "episode/staleness_turn_1": 1.5,
        "episode/staleness_turn_last": 1.5,
    }
    single = Trajectory(prompt_ids=[1], response_ids=[2], response_logprobs=[0.0], versions=[0])
    assert turn_staleness([single], 5) == {}
