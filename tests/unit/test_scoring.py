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


class Clocked(Recording):
    """Each reward call 'takes' the next of ``costs`` seconds on an injected clock."""

    def __init__(self, costs: list[float]) -> None:
        super().__init__()
        self.costs, self.now = list(costs), 0.0

    def clock(self) -> float:
        return self.now

    def reward(self, prompt: Prompt, traj: Trajectory) -> float:
        self.now += self.costs.pop(0) if self.costs else 0.0
        return super().reward(prompt, traj)


def _threads(task: Recording, start: int, stop: int | None = None) -> set[int]:
    return {thread for _, thread in task.calls[start:stop]}


def test_a_fast_reward_runs_on_the_loop_after_the_pool_timed_it():
    task = Clocked([10e-6] * 16)
    runner = RewardRunner(task, 4, inline_s=100e-6, clock=task.clock)  # type: ignore[arg-type]

    async def two_groups() -> tuple[list[float], list[float], int]:
        first = await runner.score(PROMPT, _group(8))  # timed on the pool
        second = await runner.score(PROMPT, _group(8))
        return first, second, threading.get_ident()

    try:
        first, second, loop_thread = asyncio.run(two_groups())
    finally:
        runner.close()
    assert first == second == [float(i) for i in range(8)]
    assert loop_thread not in _threads(task, 0, 8)  # the first group: on the pool
    assert _threads(task, 8) == {loop_thread} and runner.inline is True


def test_one_slow_call_sends_the_reward_back_to_the_pool_for_good():
    task = Clocked([10e-6] * 8 + [10e-6, 5e-3] + [10e-6] * 30)
    runner = RewardRunner(task, 2, inline_s=100e-6, clock=task.clock)  # type: ignore[arg-type]

    async def groups() -> int:
        for _ in range(4):
            assert await runner.score(PROMPT, _group(8)) == [float(i) for i in range(8)]
        return threading.get_ident()

    try:
        loop_thread = asyncio.run(groups())
    finally:
        runner.close()
    assert _threads(task, 8, 16) == {loop_thread}  # the second group inline, slow call too
    assert runner.inline is False and loop_thread not in _threads(task, 16)


def test_inline_zero_always_uses_the_pool():
    task = Clocked([])
    runner = RewardRunner(task, 2, inline_s=0.0, clock=task.clock)  # type: ignore[arg-type]

    async def groups() -> int:
        for _ in range(3):
            await runner.score(PROMPT, _group(4))
        return threading.get_ident()

    try:
        loop_thread = asyncio.run(groups())
    finally:
        runner.close()
    assert loop_thread not in _threads(task, 0) and runner.inline is False
