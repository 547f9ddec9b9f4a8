"""Counters of the rollout orchestrator, reported as flat `rollout/...` metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields


@dataclass
class _Window:
    done: int = 0
    filtered: int = 0
    cancelled: int = 0
    failures: int = 0
    resumed: int = 0
    control_errors: int = 0
    tokens: int = 0
    completions: int = 0
    reward_sum: float = 0.0
    gen_s: float = 0.0
    score_s: float = 0.0
    episodes: int = 0
    turns: int = 0
    env_s: float = 0.0
    env_steps: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    turn_versions: int = 0  # sum over episodes of the versions their turns span
    role_reward: dict[str, float] = field(default_factory=dict)
    role_count: dict[str, int] = field(default_factory=dict)


COUNTERS = tuple(f.name for f in fields(_Window) if not f.name.startswith("role_"))


class RolloutStats:
    """Counts since the last report and since the start."""

    def __init__(self, client_retries: int = 0) -> None:
        self._w, self._total = _Window(), _Window()
        self._client_retries = client_retries
        self._last = time.monotonic()

    def count(self, name: str, value: float = 1) -> None:
        for window in (self._w, self._total):
            setattr(window, name, getattr(window, name) + value)

    def role(self, role: str, reward: float) -> None:
        """One episode trajectory of ``role`` with ``reward``."""
        for window in (self._w, self._total):
            window.role_reward[role] = window.role_reward.get(role, 0.0) + reward
            window.role_count[role] = window.role_count.get(role, 0) + 1

    def report(self, *, generating: int, cursor: int, client_retries: int) -> dict[str, float]:
        """Flat scalars; names without `_total` cover the time since the last report.
        client_retries: the client's running count of re-sent /generate attempts."""
        w, t = self._w, self._total
        now = time.monotonic()
        elapsed, self._last = now - self._last, now
        retried, self._client_retries = client_retries - self._client_retries, client_retries
        out = {
            "rollout/groups_done": float(w.done),
            "rollout/groups_filtered": float(w.filtered),
            "rollout/groups_cancelled": float(w.cancelled),
            "rollout/group_failures": float(w.failures),
            "rollout/retries": float(retried),
            "rollout/resumed": float(w.resumed),
            "rollout/control_errors": float(w.control_errors),
            "rollout/tokens": float(w.tokens),
            "rollout/tokens_per_s": w.tokens / elapsed if elapsed > 0 else 0.0,
            "rollout/completions": float(w.completions),
            "rollout/reward_mean": w.reward_sum / w.completions if w.completions else 0.0,
            "rollout/gen_s": w.gen_s,
            "rollout/score_s": w.score_s,
            "rollout/generating": float(generating),
            "rollout/cursor": float(cursor),
            "rollout/groups_done_total": float(t.done),
            "rollout/groups_filtered_total": float(t.filtered),
            "rollout/groups_cancelled_total": float(t.cancelled),
            "rollout/group_failures_total": float(t.failures),
        }
        if w.episodes:
            out.update(
                {
                    "episode/count": float(w.episodes),
                    "episode/turns_mean": w.turns / w.episodes,
                    "episode/env_step_s": w.env_s / w.env_steps if w.env_steps else 0.0,
                    "episode/tool_calls": float(w.tool_calls),
                    "episode/tool_error_rate": (
                        w.tool_errors / w.tool_calls if w.tool_calls else 0.0
                    ),
                    "episode/versions_spanned_mean": w.turn_versions / w.episodes,
                }
            )
            for role, total in w.role_reward.items():
                out[f"episode/reward_{role}"] = total / w.role_count[role]
        self._w = _Window()
        return out
