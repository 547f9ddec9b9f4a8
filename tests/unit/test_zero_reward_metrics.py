"""Issue 31: a reward of 0 had no metric saying why (a verifier's require_stop on
responses cut at max_new_tokens looked like a policy that never answers)."""

from __future__ import annotations

import numpy as np

from moerl.common.trajectory import Trajectory
from moerl.telemetry.runlog import zero_reward_metrics


def _traj(reward: float, finish: str, reason: str | None = None) -> Trajectory:
    t = Trajectory(
        prompt_ids=np.array([1], np.int32), response_ids=np.array([2, 3], np.int32),
        response_logprobs=np.zeros(2, np.float32), versions=np.zeros(2, np.int32),
        finish_reason=finish, reward=reward,
    )  # fmt: skip
    if reason:
        t.meta["reward_reason"] = reason
    return t


def test_zero_rewards_are_counted_by_reason():
    trajs = [
        _traj(0.0, "length", "truncated (require_stop)"),
        _traj(0.0, "length", "truncated (require_stop)"),
        _traj(0.0, "stop", "2/3 passed; test 1: AssertionError"),
        _traj(1.0, "stop"),
    ]
    m = zero_reward_metrics(trajs)
    assert m["response_truncated_frac"] == 0.5 and m["reward_zero_frac"] == 0.75
    assert m["reward_zero/truncated"] == 0.5 and m["reward_zero/passed"] == 0.25
    assert len([k for k in m if k.startswith("reward_zero/")]) == 2


def test_many_reasons_keep_eight_keys_and_other():
    trajs = [_traj(0.0, "stop", f"{word} failed") for word in "abcdefghij"]
    m = zero_reward_metrics(trajs)
    assert len([k for k in m if k.startswith("reward_zero/")]) == 9
    assert m["reward_zero/other"] == 0.2
