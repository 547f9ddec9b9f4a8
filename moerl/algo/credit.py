"""Credit assignment: trajectories' rewards → the advantages their tokens are trained with
(docs/architecture.md, "Episodes").

# S samples handed to the advantage estimator, A actions (policy segments) of a trajectory

A baseline is shared by the trajectories of one group *and one role*: in a multi-agent
episode the proposer's and the solver's trajectories are compared only with their own
role's, so each role is trained with that role's reward. Single completions (no role) keep
their group as it is.

- ``outcome`` (default): one sample per trajectory, its reward (for an episode the sum of
  its actions' rewards); the estimator's advantage goes to every trained token.
- ``turn``: one sample per action of an episode, the action's discounted return from
  that action on, G_k = sum over j >= k of discount^(j-k) r_j; the samples of a group and
  role share the estimator's baseline, and each action's tokens get its own advantage.
  Trajectories without segments (single completions) are one sample, as under outcome.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from moerl.algo.advantages import AdvantageInput, AdvantageOutput
from moerl.common.checks import one_of
from moerl.common.trajectory import Trajectory

CREDITS = ("outcome", "turn")


@dataclass
class Credit:
    """The step's advantages: per trajectory a number, or one per response token [R]."""

    advantages: list[float | np.ndarray]
    metrics: dict[str, float] = field(default_factory=dict)


def action_rewards(t: Trajectory) -> list[float]:
    """Rewards of the trajectory's actions (policy segments) in order; a missing one is 0."""
    return [float(s.reward or 0.0) for s in t.actions]


def discounted_returns(rewards: list[float], discount: float) -> list[float]:
    """G_k = r_k + discount · G_{k+1}."""
    out, running = [0.0] * len(rewards), 0.0
    for k in range(len(rewards) - 1, -1, -1):
        running = rewards[k] + discount * running
        out[k] = running
    return out


def _group_key(t: Trajectory, i: int) -> tuple[object, object]:
    group = t.group_id if t.group_id is not None else f"#{i}"
    return group, t.role


def assign_credit(
    trajs: list[Trajectory],
    estimator: Callable[[AdvantageInput], AdvantageOutput],
    *,
    credit: str = "outcome",
    discount: float = 1.0,
) -> Credit:
    """The advantages of ``trajs`` (rewards set) under ``credit`` (module docstring)."""
    one_of("algo.credit", credit, CREDITS)
    if not 0.0 <= discount <= 1.0:
        raise ValueError(f"algo.turn_discount={discount} must be in [0, 1]")
    keys: dict[tuple[object, object], int] = {}
    rewards: list[float] = []
    groups: list[int] = []
    owner: list[tuple[int, int]] = []  # (trajectory, action index or -1 for the whole)
    for i, t in enumerate(trajs):
        if t.reward is None:
            raise ValueError(f"{t.name()} has no reward: score it before training")
        gid = keys.setdefault(_group_key(t, i), len(keys))
        per_action = action_rewards(t) if credit == "turn" else []
        if not per_action:
            rewards.append(float(t.reward))
            groups.append(gid)
            owner.append((i, -1))
            continue
        for k, ret in enumerate(discounted_returns(per_action, discount)):
            rewards.append(ret)
            groups.append(gid)
            owner.append((i, k))
    out = estimator(
        AdvantageInput(
            rewards_S=torch.tensor(rewards, dtype=torch.float32),
            group_ids_S=torch.tensor(groups, dtype=torch.long),
        )
    )
    adv_S = out.advantages_S.tolist()
    advantages: list[float | np.ndarray] = [0.0] * len(trajs)
    for (i, k), a in zip(owner, adv_S):
        if k < 0:
            advantages[i] = float(a)
            continue
        if not isinstance(advantages[i], np.ndarray):
            advantages[i] = np.zeros(trajs[i].response_len, dtype=np.float32)
        seg = trajs[i].actions[k]
        advantages[i][seg.start : seg.end] = a  # type: ignore[index]
    return Credit(advantages=advantages, metrics=dict(out.metrics))
