"""Trajectory: validation messages, JSON round trip, jsonl helpers."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moerl.common.trajectory import Trajectory, load_jsonl, save_jsonl

# P=3 prompt tokens, R=2 response tokens, L=2 layers, K=2 experts per token, E=4 experts
ROUTES_TLK = np.array(
    [
        [[0, 1], [2, 3]],
        [[3, 0], [1, 2]],
        [[1, 2], [0, 3]],
        [[2, 1], [3, 0]],
    ],
    dtype=np.int32,
)


def make(**overrides) -> Trajectory:
    fields = dict(
        prompt_ids=[5, 6, 7],
        response_ids=[8, 9],
        response_logprobs=[-0.5, -1.25],
        versions=[3, 4],
        sampling_logprobs=[-0.25, -0.5],
        routed_experts=ROUTES_TLK,
        mask_ids=[8, 1, 9, 2, 3],
        mask_offsets=[0, 2, 5],
        temperature=0.7,
        finish_reason="stop",
        reward=1.0,
        group_id=7,
        index=1,
        meta={"rid": "r-1"},
    )
    fields.update(overrides)
    return Trajectory(**fields)


def test_fields_are_coerced_to_numpy():
    traj = make()
    assert traj.prompt_ids.dtype == np.int32 and traj.prompt_ids.shape == (3,)
    assert traj.response_logprobs.dtype == np.float32
    assert traj.versions.dtype == np.int32
    assert traj.routed_experts.dtype == np.int32 and traj.routed_experts.shape == (4, 2, 2)
    assert traj.mask_row(1).tolist() == [9, 2, 3]
    assert traj.validate(num_layers=2, topk=2, num_experts=4) is traj


def test_int16_routing_is_kept():
    traj = make(routed_experts=ROUTES_TLK.astype(np.int16))
    assert traj.routed_experts.dtype == np.int16
    traj.validate(num_layers=2, topk=2, num_experts=4)


@pytest.mark.parametrize(
    "overrides, check, needle",
    [
        ({"routed_experts": ROUTES_TLK[:3]}, {}, "3 rows but prompt (3) + response (2) - 1 = 4"),
        ({}, {"num_layers": 3}, "2 layers but the model has num_layers=3"),
        ({}, {"topk": 4}, "top-k 2 but the model routes topk=4"),
        ({}, {"num_experts": 3}, "expert id 3, out of range for num_experts=3"),
        ({"routed_experts": ROUTES_TLK - 1}, {}, "negative expert id (-1)"),
        ({"routed_experts": ROUTES_TLK[:, 0]}, {}, "must be 3-D"),
        (
            {"mask_offsets": [0, 2]},
            {},
            "mask_offsets has 2 entries, expected response length + 1 = 3",
        ),
        ({"mask_offsets": [0, 2, 4]}, {}, "rise from 0 to len(mask_ids)=5"),
        ({"mask_offsets": [1, 2, 5]}, {}, "got first=1 last=5"),
        ({"mask_offsets": [0, 6, 5]}, {}, "rise from 0"),
        ({"mask_ids": [1, 8, 7, 2, 3]}, {}, "sampled token 9 at response position 1"),
        ({"mask_ids": None}, {}, "must be set together"),
        ({"versions": [3]}, {}, "versions has 1 entries but response_ids has 2"),
        ({"response_logprobs": [-1.0]}, {}, "response_logprobs has 1 entries"),
        ({"sampling_logprobs": [-1.0, -1.0, -1.0]}, {}, "sampling_logprobs has 3 entries"),
        ({"response_logprobs": [float("nan"), -1.0]}, {}, "NaN"),
        ({"temperature": 0.0}, {}, "temperature=0.0"),
        ({"mask_ids": None, "mask_offsets": None}, {}, "sampling_logprobs is set without"),
    ],
)
def test_validate_names_trajectory_and_problem(overrides, check, needle):
    traj = make(**overrides)
    with pytest.raises(ValueError) as err:
        traj.validate(**check)
    msg = str(err.value)
    assert "group_id=7" in msg and "index=1" in msg and "rid=r-1" in msg
    assert needle in msg


def test_minimal_trajectory_without_optional_fields():
    traj = Trajectory(prompt_ids=[1], response_ids=[], response_logprobs=[], versions=[])
    traj.validate(num_layers=2, topk=2)
    assert traj.response_len == 0 and traj.routed_experts is None


def test_dict_round_trip_through_json():
    traj = make(routed_experts=ROUTES_TLK.astype(np.int16), meta={"rid": "r", "x": [1, 2]})
    d = json.loads(json.dumps(traj.to_dict()))
    back = Trajectory.from_dict(d)
    for name in (
        "prompt_ids",
        "response_ids",
        "response_logprobs",
        "versions",
        "sampling_logprobs",
        "routed_experts",
        "mask_ids",
        "mask_offsets",
    ):
        a, b = getattr(traj, name), getattr(back, name)
        assert a.dtype == b.dtype and np.array_equal(a, b), name
    assert (back.temperature, back.finish_reason, back.reward) == (0.7, "stop", 1.0)
    assert (back.group_id, back.index, back.meta) == (7, 1, {"rid": "r", "x": [1, 2]})
    assert d["routed_experts"]["shape"] == [4, 2, 2] and d["routed_experts"]["dtype"] == "int16"


def test_dict_round_trip_without_optional_arrays():
    traj = make(routed_experts=None, mask_ids=None, mask_offsets=None, sampling_logprobs=None)
    back = Trajectory.from_dict(json.loads(json.dumps(traj.to_dict())))
    assert back.routed_experts is None and back.mask_ids is None
    assert back.sampling_logprobs is None


def test_jsonl_round_trip(tmp_path):
    path = tmp_path / "rollouts.jsonl"
    trajs = [make(index=i) for i in range(3)]
    assert save_jsonl(path, trajs[:2]) == 2
    assert save_jsonl(path, trajs[2:], append=True) == 1
    back = load_jsonl(path)
    assert [t.index for t in back] == [0, 1, 2]
    assert np.array_equal(back[2].routed_experts, ROUTES_TLK)


def test_load_jsonl_names_the_bad_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(make().to_dict()) + "\n\n" + '{"prompt_ids": [1]}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:3: not a trajectory record"):
        load_jsonl(path)
