"""Engine rollouts made off-policy for the trainer's step tests (tests/dist/test_offpolicy.py,
tests/dist/test_microbatching.py)."""

from __future__ import annotations

import numpy as np


def noisy_trajectories(rollouts: str) -> list:
    """Rollouts with rewards, groups of two and μ moved off the trainer (seeded noise),
    so the IS weights differ from 1 and some truncate."""
    from moerl.common.trajectory import load_jsonl

    trajs = load_jsonl(rollouts)
    rng = np.random.default_rng(0)
    for i, t in enumerate(trajs):
        t.reward = float(np.mean(t.response_ids % 2 == 0))
        t.group_id = i // 2
        eps = (0.3 * rng.normal(size=t.response_len)).astype(np.float32)
        t.response_logprobs = t.response_logprobs + eps
        if t.sampling_logprobs is not None:
            t.sampling_logprobs = t.sampling_logprobs + eps
    return trajs
