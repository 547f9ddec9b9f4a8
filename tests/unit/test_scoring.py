"""RewardRunner: a group's rewards in order, a plain reward function in at most
``workers`` pool runs, bad rewards refused naming the prompt."""

from __future__ import annotations

import asyncio
import sys
import threading

import numpy as np
import pytest

from moerl.common.trajectory import Trajectory
from moerl.config.rollout import RolloutConfig
from moerl.rollout.scoring import INLINE_S, LONG_CALL, RewardRunner
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
    runner = RewardRunner(task, 4, inline_s=100e-6, clock=task.clock, cpu_clock=task.clock)  # type: ignore[arg-type]

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


def _clocked_runs(
    costs: list[float], groups: int, inline_s: float | None = 100e-6
) -> tuple[RewardRunner, Clocked, int]:
    """``groups`` groups of 8 through 2 workers, each call computing ``costs``' next
    seconds; the runner (``inline_s`` None: its default bound), the task and the loop's
    thread."""
    task = Clocked(costs)
    bound = {} if inline_s is None else {"inline_s": inline_s}
    runner = RewardRunner(task, 2, clock=task.clock, cpu_clock=task.clock, **bound)  # type: ignore[arg-type]

    async def run() -> int:
        for _ in range(groups):
            assert await runner.score(PROMPT, _group(8)) == [float(i) for i in range(8)]
        return threading.get_ident()

    try:
        loop_thread = asyncio.run(run())
    finally:
        runner.close()
    return runner, task, loop_thread


def test_calls_that_computed_long_send_the_reward_back_to_the_pool_for_good():
    runner, task, loop_thread = _clocked_runs([10e-6] * 8 + [10e-6, 5e-3, 5e-3] + [10e-6] * 29, 5)
    assert _threads(task, 8, 16) == {loop_thread}  # the second group inline, slow calls too
    assert runner.inline is False and loop_thread not in _threads(task, 16)


def test_one_call_that_computed_long_does_not_send_a_fast_reward_back_to_the_pool():
    """A microsecond reward whose one call ran long (a garbage collection fell in it) went
    to the pool for good, and every later group paid its thread hand-offs."""
    runner, task, loop_thread = _clocked_runs([10e-6] * 8 + [10e-6, 5e-3] + [10e-6] * 30, 5)
    assert _threads(task, 8) == {loop_thread} and runner.inline is True
    assert (runner.calls, runner.heavy) == (32, 1)


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


class Waiting(Recording):
    """Each reward call 'takes' the next (wall, cpu) seconds of ``costs`` on two injected
    clocks: a wall time above its CPU time is a wait (the interpreter lock, or I/O)."""

    def __init__(self, costs: list[tuple[float, float]]) -> None:
        super().__init__()
        self.costs, self.wall, self.cpu = list(costs), 0.0, 0.0

    def wall_clock(self) -> float:
        return self.wall

    def cpu_clock(self) -> float:
        return self.cpu

    def reward(self, prompt: Prompt, traj: Trajectory) -> float:
        wall, cpu = self.costs.pop(0) if self.costs else (0.0, 0.0)
        self.wall, self.cpu = self.wall + wall, self.cpu + cpu
        return super().reward(prompt, traj)


def _waiting_runs(costs: list[tuple[float, float]], groups: int) -> tuple[RewardRunner, set]:
    """``groups`` groups of 8 through one worker (the calls keep ``costs``' order); the
    runner and the threads each group's calls ran on."""
    task = Waiting(costs)
    runner = RewardRunner(
        task,
        1,
        inline_s=100e-6,
        clock=task.wall_clock,
        cpu_clock=task.cpu_clock,  # type: ignore[arg-type]
    )

    async def run() -> int:
        for _ in range(groups):
            assert await runner.score(PROMPT, _group(8)) == [float(i) for i in range(8)]
        return threading.get_ident()

    try:
        loop_thread = asyncio.run(run())
    finally:
        runner.close()
    return runner, {g: loop_thread in _threads(task, 8 * g, 8 * g + 8) for g in range(groups)}


FAST, WAITED = (10e-6, 10e-6), (5e-3, 10e-6)  # a microsecond reward; one that waited 5 ms
IO_WAIT = (20e-3, 10e-6)  # a call that waited 20 ms: past two switch intervals, I/O


def test_a_wait_for_the_interpreter_lock_does_not_keep_a_fast_reward_off_the_loop():
    """Timed by wall time alone, one call of the first group that waited for the lock (the
    trainer's thread holds it for milliseconds) kept the reward on the pool for good."""
    runner, on_loop = _waiting_runs([FAST, WAITED] + [FAST] * 6 + [FAST] * 7 + [WAITED], 3)
    assert on_loop == {0: False, 1: True, 2: True} and runner.inline is True
    assert (runner.calls, runner.waited) == (16, 0)  # 5 ms: one switch interval, the lock


def test_a_reward_that_waits_in_every_call_stays_on_the_pool():
    """Blocking I/O (a synchronous verifier call) waits in every call: the first group's
    fastest call is slow, so the loop never runs it."""
    runner, on_loop = _waiting_runs([WAITED] * 24, 3)
    assert on_loop == {0: False, 1: False, 2: False} and runner.inline is False


def test_waits_past_one_call_in_fifty_send_the_reward_back_to_the_pool():
    runner, on_loop = _waiting_runs([FAST] * 8 + [IO_WAIT, IO_WAIT] + [FAST] * 22, 4)
    assert on_loop == {0: False, 1: True, 2: False, 3: False} and runner.inline is False


def test_waits_as_long_as_the_interpreter_lock_takes_keep_a_fast_reward_on_the_loop():
    """With generation beside training the trainer's thread holds the lock often: two of
    the asynchronous recipe's first 64 calls on the loop waited for it, and counted as
    waits they sent every later group to the pool (6.4 ms of wall a group against 0.9).
    A wait of one switch interval (5 ms) is the lock's; only a longer one counts."""
    assert sys.getswitchinterval() == pytest.approx(5e-3)
    runner, on_loop = _waiting_runs([FAST] * 8 + [WAITED, WAITED, WAITED] + [FAST] * 21, 4)
    assert on_loop == {0: False, 1: True, 2: True, 3: True} and runner.inline is True
    assert (runner.calls, runner.waited) == (24, 0)


def test_a_slow_first_call_of_the_run_does_not_keep_a_fast_reward_off_the_loop():
    """The run's first call may import or warm caches (2 ms of CPU); the group's fastest
    call decides."""
    runner, on_loop = _waiting_runs([(2e-3, 2e-3)] + [FAST] * 7, 2)
    assert on_loop == {0: False, 1: True} and runner.inline is True


def test_pool_shares_after_the_first_count_nothing():
    """Groups scored while the first was still being timed run on the pool too; their
    calls (whose threads wait for the lock more) neither decide nor count as the loop's."""
    task = Waiting([FAST] * 4 + [WAITED] * 4 + [FAST] * 4)
    runner = RewardRunner(
        task,
        2,
        inline_s=100e-6,
        clock=task.wall_clock,
        cpu_clock=task.cpu_clock,  # type: ignore[arg-type]
    )
    runner._timed(PROMPT, _group(4))  # the first share timed, on the pool: fast
    assert runner.inline is True
    runner._timed(PROMPT, _group(4))  # another group's share, still on the pool: waited
    assert runner.inline is True and (runner.calls, runner.waited) == (0, 0)
    runner._timed(PROMPT, _group(4), on_loop=True)
    assert (runner.calls, runner.waited) == (4, 0)
    runner.close()


def test_a_slow_first_call_in_every_group_keeps_a_fast_reward_on_the_loop():
    """Seen on the recipe: the first call of a step's first group computed past the
    bound (its caches cold after the trainer's step) and the reward went to the pool for
    good, ~1 ms a group in thread hand-offs. Only a group's median call, or calls past
    LONG_CALL times the bound, count."""
    cold = [200e-6] + [10e-6] * 7  # a first call twice the bound, the rest fast
    runner, task, loop_thread = _clocked_runs([10e-6] * 8 + cold * 6, 7)
    assert _threads(task, 8) == {loop_thread} and runner.inline is True
    assert (runner.calls, runner.heavy) == (48, 0)


def test_a_reward_whose_typical_call_computes_long_goes_back_to_the_pool():
    """Fast when timed on the pool, then 150 µs a call: the first group on the loop says
    so by its median, and the rest go to the pool."""
    runner, task, loop_thread = _clocked_runs([10e-6] * 8 + [150e-6] * 32, 5)
    assert _threads(task, 8, 16) == {loop_thread}
    assert runner.inline is False and loop_thread not in _threads(task, 16)


def test_a_reward_of_a_hundred_microseconds_a_call_stays_on_the_loop_by_default():
    """copy_digits' shaped reward (a tokenizer decode and a comparison) computed 80-120 µs
    a call in the tiny recipe's run, its caches cold after the trainer's step: at a 100 µs
    bound the first group sent it to the pool in every run, and the synchronous step's
    last group took 4.5-6.5 ms there against 0.9 ms on the loop. At the default bound
    (``rollout.reward_inline_us``) it runs on the loop; a call of 5 ms computes long."""
    runner, task, loop_thread = _clocked_runs([80e-6, 120e-6, 110e-6, 95e-6] * 6, 3, None)
    assert runner.inline_s == INLINE_S == RolloutConfig().reward_inline_us * 1e-6
    assert loop_thread not in _threads(task, 0, 8)  # timed on the pool
    assert _threads(task, 8) == {loop_thread} and runner.inline is True
    assert 5e-3 >= LONG_CALL * runner.inline_s  # what counts as long stays long
