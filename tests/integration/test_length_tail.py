"""rollout.length_distribution=lognormal: per-completion lengths are long-tailed,
deterministic per (seed, prompt position, index), validated, and the embedded engine
returns responses of exactly those lengths whatever the model samples."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import numpy as np
import pytest

from moerl.config.buffer import BufferConfig, StalenessConfig
from moerl.config.rollout import RolloutConfig
from moerl.rollout import EngineClient
from moerl.rollout.buffer import RolloutBuffer
from moerl.rollout.orchestrator import Orchestrator
from moerl.tasks.base import Prompt

L, K = 4, 4  # the tiny DeepSeek model: 4 hidden layers, top-4 routing


class FourPrompts:
    """Four 4-token prompts; reward = response length (nothing here learns)."""

    def prompts(self, start: int = 0):  # type: ignore[no-untyped-def]
        for i in range(start, 4):
            yield Prompt(i, np.array([3 + (7 * i + j) % 100 for j in range(4)], np.int32))

    def reward(self, prompt: Prompt, traj) -> float:  # type: ignore[no-untyped-def]
        return float(traj.response_len)


TAIL = RolloutConfig(
    group_size=4,
    max_inflight_groups=4,
    max_new_tokens=256,
    top_k=20,
    length_distribution="lognormal",
    length_median=4,
    length_sigma=1.5,
)


def test_lognormal_lengths_are_long_tailed_and_deterministic():
    lengths = np.array([TAIL.completion_length(g, i) for g in range(256) for i in range(8)])
    p50, p90 = np.percentile(lengths, [50, 90])
    assert p90 / p50 >= 5.0, (p50, p90)
    assert lengths.min() >= 1 and lengths.max() <= TAIL.max_new_tokens
    # Pinned draws (found once): the same (length_seed, group, index) gives the same length
    # in every process and run; (48, 2) is clipped to max_new_tokens.
    pinned = {(0, 0): 2, (1, 0): 1, (0, 4): 6, (7, 3): 9, (13, 3): 125, (48, 2): 256}
    assert {gi: TAIL.completion_length(*gi) for gi in pinned} == pinned
    assert {gi: int(lengths[8 * gi[0] + gi[1]]) for gi in pinned} == pinned  # any call order
    other = replace(TAIL, length_seed=1)
    assert [other.completion_length(g, 0) for g in range(32)] != list(lengths[:256:8])
    assert RolloutConfig().completion_length(0, 0) is None  # 'fixed': EOS or max_new_tokens
    short = replace(TAIL, max_new_tokens=8, length_median=8)
    assert max(short.completion_length(g, 0) for g in range(64)) == 8  # clipped


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"length_distribution": "pareto"}, "length_distribution='pareto'"),
        ({"length_median": 300}, "length_median=300 must be in [1, rollout.max_new_tokens=256]"),
        ({"length_median": 0}, "length_median=0 must be >= 1"),
        ({"length_sigma": -0.5}, "length_sigma=-0.5 must be >= 0.0"),
    ],
)
def test_length_options_are_validated(change, words):
    with pytest.raises(ValueError) as err:
        replace(TAIL, **change).validate()
    assert words in str(err.value)


def test_responses_have_the_drawn_lengths(ds_engine):
    cfg = replace(TAIL, max_new_tokens=48)

    async def go():  # type: ignore[no-untyped-def]
        async with EngineClient([ds_engine.url]) as client:
            buffer = RolloutBuffer(BufferConfig(max_groups=8), StalenessConfig(throttle=False))
            orch = Orchestrator(client, FourPrompts(), buffer, cfg, num_layers=L, topk=K)
            await asyncio.wait_for(orch.run(), 60)  # returns once the 4 prompts are used
            return await buffer.get_batch(len(buffer), 0)

    groups = asyncio.run(go())
    trajs = [t for group in groups for t in group]
    assert len(trajs) == 16
    for traj in trajs:
        assert traj.response_len == cfg.completion_length(traj.group_id, traj.index)
        traj.validate(num_layers=L, topk=K, num_experts=8)
    assert len({t.response_len for t in trajs}) > 3  # lengths really differ
