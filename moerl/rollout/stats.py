"""Counters of the rollout orchestrator, reported as flat `rollout/...` metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass, fields


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


COUNTERS = tuple(f.name for f in fields(_Window))


class RolloutStats:
    """Counts since the last report and since the start."""

    def __init__(self, client_retries: int = 0) -> None:
        self._w, self._total = _Window(), _Window()
        self._client_retries = client_retries
        self._last = time.monotonic()

    def count(self, name: str, value: float = 1) -> None:
        for window in (self._w, self._total):
            setattr(window, name, getattr(window, name) + value)

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
        self._w = _Window()
        return out
