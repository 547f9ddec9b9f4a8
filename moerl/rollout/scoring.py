"""Scoring a group off the critical path, and the all-or-nothing gather a group needs.

A task's reward is a plain function (run on a private thread pool, so a slow verifier never
blocks the event loop that keeps other groups generating) or a coroutine function (a remote
verifier or reward model, awaited on the loop). A plain function whose calls compute for
less than ``inline_s`` (``rollout.reward_inline_us``) runs on the loop instead: a string
comparison of a few microseconds cost a millisecond per group in thread hand-offs on 2
cores. The first group always goes to the pool, which times each call twice: the CPU
time of its thread and the wall time. A call whose wall time passed the bound on little CPU
waited: for the interpreter lock, which the trainer's thread holds for milliseconds at a
time, or on I/O. Timed by wall time alone, one wait of the first kind kept a microsecond
reward on the pool for the whole run (every call of a 60-step run went through the pool).
So the first group decides by its fastest call (a function that blocks on I/O waits in
every call; the first call of the run may warm caches), and on the loop the function goes
back to the pool when a group's median call computed past the bound, or once more than
one call in 50 (at least 2) computed past ten times the bound (``LONG_CALL``) or waited.
A call that passes the bound now and then does not send it back: a 15 µs reward
(copy_digits) computed past 100 µs in the first call of a step's first group (its caches
cold after the trainer's step, or a garbage collection falls in it) two steps in a row,
and every later group paid the pool's hand-offs, 1.1-1.5 ms a group where the loop takes
0.12. The bound is 500 µs a call by default: with the cold caches a synchronous step
leaves, that reward computed 80-120 µs a call, and at a 100 µs bound the first group sent
it to the pool in every run, where the step's last group, which the trainer waits for,
took 4.5-6.5 ms against 0.9 on the loop.

On the loop, a call "waited" when it spent more than ``GIL_WAITS`` switch intervals
(``sys.getswitchinterval()``, 5 ms by default) off its CPU: a thread that wants the
interpreter lock has it back within about one interval (it asks the holder to drop it
after one), so a shorter wait says nothing about I/O. With generation beside training
the trainer's thread holds the lock often: 2 of the first 64 calls of the asynchronous
recipe waited that long for it, counted as waits, and every later group went to the pool,
6.4 ms of wall a group (p90 15 ms) where the loop took 0.9.
"""

# G completions per group

from __future__ import annotations

import asyncio
import inspect
import math
import sys
import threading
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


INLINE_S = 500e-6
"""The default bound under which a plain reward runs on the loop (seconds of CPU a call;
``rollout.reward_inline_us`` holds the same number for a run)."""

GIL_WAITS = 2
"""A call on the loop waited (I/O, not the interpreter lock) when its wall time passed its
CPU time by more than this many switch intervals."""

LONG_CALL = 10
"""On the loop, a call whose CPU time passes this many times ``inline_s`` counts as long
(it held the loop ~1 ms at the default bound); one that passes the bound alone does not."""


class RewardRunner:
    """Calls task.reward for every completion of a group, concurrently: a coroutine
    function once per completion on the loop, a plain function in at most ``workers``
    runs on the pool, each scoring a contiguous share of the group in order (one
    thread hand-off per share, not per completion)."""

    def __init__(
        self,
        task: Task,
        workers: int,
        inline_s: float = INLINE_S,
        clock: Callable[[], float] = time.perf_counter,
        cpu_clock: Callable[[], float] = time.thread_time,
    ) -> None:
        """``inline_s``: the bound under which a plain function runs on the loop (0: never);
        ``clock`` (wall) and ``cpu_clock`` (the calling thread's CPU) time its calls."""
        self.task = task
        self.clock, self.cpu_clock = clock, cpu_clock
        # calls timed on the loop, those that waited and those that computed long
        self.calls = self.waited = self.heavy = 0
        self._lock = threading.Lock()  # the first group's shares are timed in parallel
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
            values = self._timed(prompt, list(group), on_loop=True)
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

    def _timed(self, prompt: Prompt, share: list[Trajectory], on_loop: bool = False) -> list[Any]:
        """The reward of each completion, each call timed (module docstring). On the pool
        the first share timed decides ``inline`` by its fastest call (the other pool
        shares of the groups scored meanwhile count nothing: their threads wait for the
        lock more); on the loop (``on_loop``) it sets False for good when the share's
        median call computed long, or when more than one call in 50 (at least 2) held
        the loop for ``LONG_CALL`` times the bound or waited (past ``GIL_WAITS`` switch
        intervals)."""
        reward, values, cpus = self.task.reward, [], []
        fastest, waited = math.inf, 0
        lock_wait = GIL_WAITS * sys.getswitchinterval()
        for traj in share:
            wall, cpu = self.clock(), self.cpu_clock()
            values.append(reward(prompt, traj))
            wall, cpu = self.clock() - wall, self.cpu_clock() - cpu
            cpus.append(cpu)
            fastest = min(fastest, wall)
            waited += wall - cpu > max(lock_wait, self.inline_s) and cpu < self.inline_s
        cpus.sort()
        with self._lock:
            if not on_loop:
                if self.inline is None:  # by its fastest call: a first call may warm caches
                    self.inline = cpus[0] < self.inline_s and fastest < self.inline_s
            elif self.inline:
                self.calls += len(share)
                self.waited += waited
                self.heavy += sum(c >= LONG_CALL * self.inline_s for c in cpus)
                bound = max(1, self.calls // 50)
                typical = cpus[len(cpus) // 2]
                if typical >= self.inline_s or self.heavy > bound or self.waited > bound:
                    self.inline = False
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
