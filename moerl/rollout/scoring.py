"""Scoring a group off the critical path, and the all-or-nothing gather a group needs.

A task's reward is a plain function (run on a private thread pool, so a slow verifier never
blocks the event loop that keeps other groups generating) or a coroutine function (a remote
verifier or reward model, awaited on the loop). A plain function whose every call so far
took less than ``inline_s`` (``rollout.reward_inline_us``) runs on the loop instead: a
string comparison of a few microseconds cost a millisecond per group in thread hand-offs
on 2 cores. The first group always goes to the pool, which times each call, and the first
call over the bound sends the function back to the pool for good.
"""

# G completions per group

from __future__ import annotations

import asyncio
import inspect
import math
import time
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from moerl.common.trajectory import Trajectory
from moerl.tasks.base import Prompt, Task

T = TypeVar("T")


async def gather_or_cancel(coros: Sequence[Coroutine[Any, Any, T]]) -> list[T]:
    """Run concurrently; on the first error (or a cancel) cancel the rest, wait for them
    and raise it. asyncio.gather would leave the others running."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        pending = [t for t in tasks if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
    # the first error in order (each one retrieved, so none is logged as never retrieved)
    errors = [t.exception() for t in tasks if not t.cancelled()]
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return [t.result() for t in tasks]


def uniform(rewards: Sequence[float]) -> bool:
    """All rewards equal: GRPO-style advantages are zero, the group teaches nothing."""
    return max(rewards) == min(rewards)


async def _awaited(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class RewardRunner:
    """Calls task.reward for every completion of a group, concurrently: a coroutine
    function once per completion on the loop, a plain function in at most ``workers``
    runs on the pool, each scoring a contiguous share of the group in order (one
    thread hand-off per share, not per completion)."""

    def __init__(
        self,
        task: Task,
        workers: int,
        inline_s: float = 100e-6,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """``inline_s``: the bound under which a plain function runs on the loop (0: never);
        ``clock`` times its calls."""
        self.task = task
        self.clock = clock
        self.workers = workers
        self.inline_s = inline_s
        self._is_async = inspect.iscoroutinefunction(task.reward)
        self._pool: ThreadPoolExecutor | None = None
        # None: not timed yet; True: every call so far was under inline_s (run on the loop)
        self.inline: bool | None = None if inline_s > 0 else False

    async def score(self, prompt: Prompt, group: Sequence[Trajectory]) -> list[float]:
        """One float per completion, in order; ValueError for a non-finite reward."""
        if self._is_async:
            return await gather_or_cancel([self._one(prompt, traj) for traj in group])
        if self.inline:
            values = self._timed(prompt, list(group))
            if any(inspect.isawaitable(v) for v in values):
                values = await gather_or_cancel([_awaited(v) for v in values])
            return [self._checked(prompt, traj, value) for traj, value in zip(group, values)]
        n = max(1, min(self.workers, len(group)))
        shares = [list(group[i * len(group) // n : (i + 1) * len(group) // n]) for i in range(n)]
        scored = await gather_or_cancel([self._share(prompt, share) for share in shares])
        return [reward for share in scored for reward in share]

    async def _share(self, prompt: Prompt, share: list[Trajectory]) -> list[float]:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="moerl-reward")
        values = await asyncio.get_running_loop().run_in_executor(
            self._pool, self._timed, prompt, share
        )
        if any(inspect.isawaitable(v) for v in values):  # a plain function returned coroutines
            values = await gather_or_cancel([_awaited(v) for v in values])
        return [self._checked(prompt, traj, value) for traj, value in zip(share, values)]

    def _timed(self, prompt: Prompt, share: list[Trajectory]) -> list[Any]:
        """The reward of each completion, each call timed: ``inline`` turns True after
        the first share whose calls were all fast, False for good at the first slow one."""
        reward, values, slowest = self.task.reward, [], 0.0
        for traj in share:
            start = self.clock()
            values.append(reward(prompt, traj))
            slowest = max(slowest, self.clock() - start)
        if slowest >= self.inline_s:
            self.inline = False
        elif self.inline is None:
            self.inline = True
        return values

    async def _one(self, prompt: Prompt, traj: Trajectory) -> float:
        value = await self.task.reward(prompt, traj)  # type: ignore[misc]
        return self._checked(prompt, traj, value)

    def _checked(self, prompt: Prompt, traj: Trajectory, value: Any) -> float:
        try:
            reward = float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            reward = math.nan
        if not math.isfinite(reward):
            raise ValueError(
                f"{type(self.task).__name__}.reward returned {value!r} for prompt "
                f"{prompt.prompt_id} ({traj.name()}); a reward must be a finite number"
            )
        return reward

    def close(self) -> None:
        """Stop the thread pool; rewards still running finish in the background."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
