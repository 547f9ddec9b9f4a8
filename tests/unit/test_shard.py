"""Which trajectories a data-parallel rank receives whole (moerl.trainer.shard), checked
against the slicing the micro-batch builder applies to each minibatch."""

from __future__ import annotations

import numpy as np
import pytest

from moerl.common.trajectory import Trajectory
from moerl.trainer.batch import split_for_rank
from moerl.trainer.shard import light, owned_indices, shard_view


def _traj(i: int) -> Trajectory:
    return Trajectory(
        prompt_ids=np.array([1, 2, 3]), response_ids=np.array([4, 5]),
        response_logprobs=np.array([-0.5, -0.25]), versions=np.array([0, 1]),
        sampling_logprobs=np.array([-0.4, -0.2]),
        routed_experts=np.zeros((4, 2, 2), dtype=np.int32),
        mask_ids=np.array([4, 9, 5]), mask_offsets=np.array([0, 2, 3]),
        reward=float(i), group_id=i // 2, index=i % 2,
    )  # fmt: skip


def test_owned_indices_by_hand():
    assert owned_indices(8, 2, 2, 0) == [0, 1, 4, 5]
    assert owned_indices(8, 2, 2, 1) == [2, 3, 6, 7]
    assert owned_indices(8, 1, 4, 3) == [6, 7]
    with pytest.raises(ValueError, match="trainer.minibatches=2 × data-parallel size 3"):
        owned_indices(8, 2, 3, 0)


@pytest.mark.parametrize(
    ("num", "minibatches", "dp", "mbs"), [(8, 2, 2, 1), (16, 2, 4, 2), (12, 3, 2, 2)]
)
def test_owned_is_what_each_minibatch_gives_the_rank(num, minibatches, dp, mbs):
    per = num // minibatches
    for rank in range(dp):
        used = [
            k * per + i
            for k in range(minibatches)
            for group in split_for_rank(per, dp, rank, mbs)
            for i in group
        ]
        assert owned_indices(num, minibatches, dp, rank) == used
    every = sorted(i for r in range(dp) for i in owned_indices(num, minibatches, dp, r))
    assert every == list(range(num))  # each trajectory has exactly one owner


def test_a_view_keeps_what_the_whole_batch_needs_and_only_owned_routes():
    trajs = [_traj(i) for i in range(4)]
    view = shard_view(trajs, [2, 3])
    assert view[2] is trajs[2] and view[3] is trajs[3]
    for t, v in zip(trajs[:2], view[:2]):
        assert v.routed_experts is None and v.mask_ids is None and v.mask_offsets is None
        assert np.array_equal(v.prompt_ids, t.prompt_ids)
        assert np.array_equal(v.response_ids, t.response_ids)
        assert np.array_equal(v.response_logprobs, t.response_logprobs)
        assert np.array_equal(v.sampling_logprobs, t.sampling_logprobs)
        assert np.array_equal(v.versions, t.versions)
        assert (v.reward, v.group_id, v.index) == (t.reward, t.group_id, t.index)
    assert trajs[0].routed_experts is not None  # the batch itself is untouched
    assert light(trajs[0]).routed_experts is None
