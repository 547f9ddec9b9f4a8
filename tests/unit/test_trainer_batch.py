"""Trajectories → micro-batches: alignment of labels, masks and routes; bad input."""

from __future__ import annotations

import numpy as np
import pytest

from moerl.common.trajectory import Trajectory
from moerl.trainer.batch import (
    build_microbatch,
    pack_rows,
    rows_within,
    split_for_rank,
    split_groups,
    token_groups,
)


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


def test_token_groups_fill_the_budget_longest_first():
    """Rows × the group's padded longest stays within the budget; like lengths share a
    micro-batch; a sequence over the budget goes alone; every position appears once."""
    lengths = [5, 30, 6, 29, 7, 100, 31]
    groups = token_groups(lengths, max_tokens=64, multiple=2)
    # longest first: 100 alone; 32 + 30 (2 × 32 = 64); 30 + 8 (a third row would make 90);
    # 6 + 6
    assert groups == [[5], [1, 6], [3, 4], [0, 2]]
    for g in groups:
        padded = max(-(-lengths[i] // 2) * 2 for i in g)
        assert len(g) == 1 or padded * len(g) <= 64
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert token_groups([4] * 8, max_tokens=1000) == [list(range(8))]  # one micro-batch


def test_split_groups_reaches_the_count_and_keeps_members():
    groups = split_groups([[0, 1, 2, 3], [4], [5, 6]], 5)
    assert len(groups) == 5
    assert sorted(i for g in groups for i in g) == list(range(7))
    assert split_groups([[0, 1]], 1) == [[0, 1]]
    with pytest.raises(ValueError, match="cannot split"):
        split_groups([[0], [1]], 3)


def test_rows_within_divides_the_rank_share():
    assert rows_within(5, 12) == 4  # the largest divisor of 12 that is at most 5
    assert rows_within(0, 12) == 1  # a budget below one row still runs one
    assert rows_within(100, 7) == 7


def test_pack_rows_first_fit():
    assert pack_rows([5, 3, 4, 2, 6], 8) == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError, match="pack_length=4"):
        pack_rows([5], 4)


def test_packed_row_by_hand():
    """Two sequences in one row: each at its offset, its own positions, and attention
    only within itself (causal)."""
    a, b = _traj(p=3, r=2), _traj(p=2, r=2)
    mb = build_microbatch(
        [a, b], [7, 9], seq_len=8, topk=2, num_layers=2, num_experts=4, use_routes=True,
        use_mask=True, rows=[[0, 1]],
    )  # fmt: skip
    assert mb.tokens[0].tolist() == [10, 11, 12, 50, 10, 11, 50, 0]
    assert mb.labels[0, :7].tolist() == [11, 12, 50, 51, 11, 50, 51]
    assert mb.position_ids[0].tolist() == [0, 1, 2, 3, 0, 1, 2, 0]
    assert mb.seq_ids[0].tolist() == [0, 0, 0, 0, 1, 1, 1, -1]
    assert mb.loss_mask[0].tolist() == [False, False, True, True, False, True, True, False]
    assert np.array_equal(mb.routes[0, 4:7].numpy(), b.routed_experts)
    # b's kept sets sit at its response positions 5, 6 (flattened row-major)
    assert mb.mask_pos.tolist() == [2, 2, 3, 5, 5, 6]
    allowed = ~mb.attention_mask[0, 0]
    assert allowed[5].tolist() == [False] * 4 + [True, True, False, False]
    assert allowed[3].tolist() == [True] * 4 + [False] * 4
    # padding attends only to padding (a fully masked row would give NaN in SDPA)
    assert allowed[7].tolist() == [False] * 7 + [True] and not allowed[:7, 7].any()
