"""RewardRunner: a group's rewards in order, a plain reward function in at most
``workers`` pool runs, bad rewards refused naming the prompt."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from moerl.common.trajectory import Trajectory
from moerl.rollout.scoring import RewardRunner
from moerl.tasks.base import Prompt


class Recording:
    """A task whose reward is the completion's first token, recording each call's thread."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []  # (first token, thread id)
        self.lock = threading.Lock()

    def reward(self, prompt: Prompt, traj: Trajectory) -> float:
        with self.lock:
            self.calls.append((int(traj.response_ids[0]), threading.get_ident()))
        return float(traj.response_ids[0])


def _group(n: int) -> list[Trajectory]:
    return [
        Trajectory(prompt_ids=[1], response_ids=[i], response_logprobs=[0.0], versions=[0])
        for i in range(n)
    ]


PROMPT = Prompt(prompt_id=7, input_ids=np.array([1], dtype=np.int32))


@pytest.mark.parametrize("n, workers", [(8, 4), (3, 4), (5, 1), (1, 1)])
def test_rewards_come_in_order_from_at_most_workers_threads_off_the_loop(n, workers):
    task = Recording()
    runner = RewardRunner(task, workers)  # type: ignore[arg-type]
    try:
        got = asyncio.run(runner.score(PROMPT, _group(n)))
    finally:
        runner.close()
    assert got == [float(i) for i in range(n)]
    assert sorted(first for first, _ in task.calls) == list(range(n))  # each once
    assert len({thread for _, thread in task.calls}) <= min(n, workers)
    assert threading.get_ident() not in {thread for _, thread in task.calls}  # off the loop


class Bad(Recording):
    def reward(self, prompt: Prompt, traj: Trajectory) -> float:
        return float("nan") if traj.response_ids[0] == 2 else 0.0


def test_a_nonfinite_reward_is_refused_naming_the_prompt():
    runner = RewardRunner(Bad(), 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="for prompt 7 .*a reward must be a finite number"):
        asyncio.run(runner.score(PROMPT, _group(4)))
    runner.close()


class Deferred(Recording):
    """A plain function that returns coroutines (e.g. a partial of an async verifier)."""

    def reward(self, prompt: Prompt, traj: Trajectory):  # type: ignore[no-untyped-def, override]
        async def later() -> float:
            await asyncio.sleep(0)
            return 10.0 + float(traj.response_ids[0])

        return later()


def test_a_plain_function_returning_coroutines_is_awaited_in_order():
    runner = RewardRunner(Deferred(), 2)  # type: ignore[arg-type]
    assert asyncio.run(runner.score(PROMPT, _group(5))) == [10.0, 11.0, 12.0, 13.0, 14.0]
    runner.close()
