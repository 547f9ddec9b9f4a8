"""Routing-replay policies (moerl.algo.replay) on hand-built router tokens; their use in
the trainer's forward is tested in tests/dist/test_replay.py."""

from __future__ import annotations

import pytest
import torch

from moerl.algo.replay import (
    RecentReplayConfig,
    ReplayInput,
    build_replay_policy,
    check_replay_spec,
    is_all,
    is_none,
)
from moerl.trainer.replay import _checked


def _input(versions: list[int] | None, current: int = 5) -> ReplayInput:
    recorded = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])
    fresh = torch.tensor([[1, 0], [3, 2], [5, 4], [7, 6]])
    return ReplayInput(
        recorded_TK=recorded, current_version=current, scores_TE=torch.rand(4, 8),
        versions_T=None if versions is None else torch.tensor(versions), fresh_TK=fresh,
        layer=2,
    )  # fmt: skip


def test_builtins_choose_by_hand():
    inp = _input([5, 4, 3, 0])  # gaps 0, 1, 2, 5
    assert torch.equal(build_replay_policy("all")(inp).routes_TK, inp.recorded_TK)
    assert torch.equal(build_replay_policy("none")(inp).routes_TK, inp.fresh_TK)
    recent = build_replay_policy("recent", recent_window=1)(inp).routes_TK
    assert recent.tolist() == [[0, 1], [2, 3], [5, 4], [7, 6]]
    wide = build_replay_policy({"name": "recent", "window": 2})(inp).routes_TK
    assert wide.tolist() == [[0, 1], [2, 3], [4, 5], [7, 6]]
    with pytest.raises(ValueError, match="per-token versions"):
        build_replay_policy("recent")(_input(None))


def test_specs_are_checked_with_the_fix_named():
    assert is_none("none") and is_none({"name": "none"}) and not is_none("all")
    assert not is_none({"_target_": "x.y", "name": "none"})
    assert is_all("all") and not is_all("recent") and not is_all({"_target_": "a.b"})
    check_replay_spec({"_target_": "torch.clone"})  # importable: accepted
    with pytest.raises(ValueError, match="unknown replay policy 'some'.*_target_"):
        check_replay_spec("some")
    with pytest.raises(ValueError, match="could not be imported"):
        check_replay_spec({"_target_": "mylab.nowhere.fn"})
    with pytest.raises(ValueError, match="window=-1 must be >= 0"):
        check_replay_spec(RecentReplayConfig(window=-1))
    with pytest.raises(ValueError, match="not an option of replay policy 'all'"):
        check_replay_spec({"name": "all", "window": 3})


def test_a_policys_routes_are_checked():
    good = torch.tensor([[0, 1], [2, 3]])
    assert torch.equal(_checked(good, (2, 2), 4), good)
    with pytest.raises(TypeError, match="ReplayOutput"):
        _checked([[0, 1]], (2, 2), 4)
    with pytest.raises(ValueError, match="shape \\(2, 2\\)"):
        _checked(torch.tensor([[0, 1, 2]]), (2, 2), 4)
    with pytest.raises(ValueError, match="integer expert ids"):
        _checked(good.float(), (2, 2), 4)
    with pytest.raises(ValueError, match="outside \\[0, 4\\)"):
        _checked(torch.tensor([[0, 4], [1, 2]]), (2, 2), 4)
