"""Trajectories → micro-batches: alignment of labels, masks and routes; bad input."""

from __future__ import annotations

import numpy as np
import pytest

from moerl.rollout.trajectory import Trajectory
from moerl.trainer.batch import build_microbatch, split_for_rank


def _traj(
    p: int = 3, r: int = 2, layers: int = 2, k: int = 2, experts: int = 4, routes: bool = True
) -> Trajectory:
    rng = np.random.default_rng(p + r)
    routed = None
    if routes:
        routed = np.stack(
            [rng.permutation(experts)[:k] for _ in range((p + r - 1) * layers)]
        ).reshape(p + r - 1, layers, k)
    return Trajectory(
        prompt_ids=np.arange(10, 10 + p, dtype=np.int32),
        response_ids=np.arange(50, 50 + r, dtype=np.int32),
        response_logprobs=-np.arange(1, r + 1, dtype=np.float32),
        versions=np.zeros(r, dtype=np.int32),
        routed_experts=routed,
        mask_ids=np.array([50, 7, 51], dtype=np.int32),
        mask_offsets=np.array([0, 2, 3], dtype=np.int32),
        sampling_logprobs=np.array([-0.5, 0.0], dtype=np.float32),
        temperature=0.7,
        group_id=4,
        index=1,
    )


def test_alignment_by_hand():
    t = _traj()
    mb = build_microbatch(
        [t], [0], seq_len=6, topk=2, num_layers=2, num_experts=4, use_routes=True, use_mask=True
    )
    # inputs are prompt+response without the last token; labels are shifted by one
    assert mb.tokens[0, :4].tolist() == [10, 11, 12, 50] and mb.tokens[0, 4:].tolist() == [0, 0]
    assert mb.labels[0, :4].tolist() == [11, 12, 50, 51]
    assert mb.loss_mask[0].tolist() == [False, False, True, True, False, False]
    assert mb.sampling_logprobs[0, 2:4].tolist() == [-0.5, 0.0]
    assert mb.rollout_logprobs[0, 2:4].tolist() == [-1.0, -2.0]
    assert np.array_equal(mb.routes[0, :4].numpy(), t.routed_experts)
    assert mb.mask_pos.tolist() == [2, 2, 3] and mb.mask_ids.tolist() == [50, 7, 51]
    assert mb.lengths.tolist() == [4] and mb.valid()[0].tolist() == [True] * 4 + [False] * 2
    assert float(mb.temperature[0]) == pytest.approx(0.7)


def test_replay_without_routes_names_the_trajectory():
    with pytest.raises(ValueError, match="group=4 index=1 has no routed_experts"):
        build_microbatch([_traj(routes=False)], [0], 6, topk=2, num_layers=2, use_routes=True)


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda t: setattr(t, "routed_experts", t.routed_experts[:, :1]), ["layers"]),
        (lambda t: setattr(t, "routed_experts", t.routed_experts[:, :, :1]), ["top"]),
        (lambda t: t.routed_experts.__setitem__((0, 0, 0), 9), ["expert"]),
        (lambda t: setattr(t, "mask_offsets", np.array([0, 2], dtype=np.int32)), ["mask"]),
    ],
)
def test_bad_routes_and_masks_name_the_trajectory(edit, words):
    t = _traj()
    edit(t)
    with pytest.raises(ValueError) as err:
        build_microbatch(
            [t], [0], 6, topk=2, num_layers=2, num_experts=4, use_routes=True, use_mask=True
        )
    assert "4" in str(err.value)
    for w in words:
        assert w in str(err.value).lower()


def test_split_for_rank():
    assert split_for_rank(8, 2, 1, 2) == [[4, 5], [6, 7]]
    with pytest.raises(ValueError, match="do not split evenly"):
        split_for_rank(6, 4, 0, 1)
