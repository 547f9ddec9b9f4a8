"""The bounded rollout buffer between generation and the trainer (docs/architecture.md,
"Data flow" and "Staleness and buffer sampling").

# Q groups queued in the buffer

A group is one prompt's completions (a list of Trajectory, rewards set). Producers hold a
slot while they generate and then put the group; the trainer takes `num_groups` groups at
its current policy version:

    slot = await buffer.reserve()        # waits while the buffer is full or too far ahead
    try:
        group = await generate(prompt)   # with whatever weights the engines hold now
    except BaseException:
        buffer.release(slot)
        raise
    await buffer.put(group, slot)

    groups = await buffer.get_batch(num_groups, current_version=step)

`put(group)` without a slot reserves one first. Staleness of a group = the trainer's
version at consumption − the oldest version among its tokens. The staleness policy drops
groups at consumption; with `throttle` a producer also waits until the groups queued, in
flight and taken at the current version fit in max_staleness + 1 trainer steps, so with
max_staleness=0 generation and training alternate exactly (synchronous RL).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moerl.common.trajectory import Trajectory
from moerl.config.buffer import BufferConfig, StalenessConfig
from moerl.rollout.buffer_policies import (
    SamplingInput,
    StalenessInput,
    build_sampling,
    build_staleness,
)

Group = list[Trajectory]


class BufferClosed(RuntimeError):
    """The buffer was closed: raised by reserve, put and get_batch, also to their waiters."""


@dataclass
class Reservation:
    """A slot a producer holds while it generates one group; give it to put or release."""

    open: bool = True
    """False once the slot was used by put or given back by release."""


@dataclass
class _Entry:
    arrival: int
    min_version: int
    group: Group


@dataclass
class _Counters:
    put_wait_s: float = 0.0
    get_wait_s: float = 0.0
    consumed: int = 0
    dropped: Counter = field(default_factory=Counter)
    staleness: Counter = field(default_factory=Counter)


def _plain(cfg: Any) -> Any:
    from omegaconf import DictConfig, OmegaConf

    return OmegaConf.to_object(cfg) if isinstance(cfg, DictConfig) else cfg


def group_min_version(group: Sequence[Trajectory]) -> int:
    """The oldest policy version among the group's tokens; ValueError for a bad group."""
    if not isinstance(group, Sequence) or len(group) == 0:
        raise ValueError(f"a group must be a non-empty list of Trajectory, got {group!r}")
    versions = []
    for traj in group:
        if not isinstance(traj, Trajectory):
            raise ValueError(f"a group holds Trajectory objects, got {type(traj).__name__}")
        if traj.reward is None:
            raise ValueError(f"{traj.name()} has no reward; score the group before put")
        if traj.versions.size:
            versions.append(int(traj.versions.min()))
    if not versions:
        raise ValueError(
            f"group {group[0].group_id!r} has no response tokens, so no policy version"
        )
    return min(versions)


class RolloutBuffer:
    """Bounded asyncio queue of groups with a staleness and a sampling policy."""

    def __init__(
        self,
        buffer: BufferConfig | None = None,
        staleness: StalenessConfig | None = None,
        *,
        groups_per_step: int | None = None,
        version: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """groups_per_step: groups the trainer takes per step (needed by `throttle`).
        version: the trainer's policy version now. clock: seconds, for the wait metrics."""
        self.cfg = _plain(buffer) if buffer is not None else BufferConfig()
        self.staleness_cfg = _plain(staleness) if staleness is not None else StalenessConfig()
        self.cfg.validate("buffer")
        self.staleness_cfg.validate("staleness")
        self._staleness_fn = build_staleness(self.staleness_cfg)
        self._sampling_fn = build_sampling(self.cfg.sampling)
        self._check_step(groups_per_step)
        self.groups_per_step = groups_per_step
        self._clock = clock
        self._version = int(version)
        self._queue: list[_Entry] = []
        self._next_arrival = 0
        self._in_flight = 0
        self._taken_now = 0  # groups handed out at the current version
        self._closed = False
        self._changed = asyncio.Event()
        self._total = _Counters()
        self._window = _Counters()

    def _check_step(self, groups_per_step: int | None) -> None:
        max_groups = self.cfg.max_groups
        if groups_per_step is None:
            if self.staleness_cfg.throttle:
                raise ValueError(
                    f"staleness.throttle=true (staleness={self.staleness_cfg.name}) needs "
                    "groups_per_step, the groups the trainer takes per step: pass "
                    "RolloutBuffer(..., groups_per_step=N) or set staleness.throttle=false"
                )
            return
        if groups_per_step < 1:
            raise ValueError(f"groups_per_step={groups_per_step} must be >= 1")
        if groups_per_step > max_groups:
            raise ValueError(
                f"buffer.max_groups={max_groups} is smaller than the {groups_per_step} groups "
                f"the trainer takes per step, so it would wait forever; set "
                f"buffer.max_groups >= {groups_per_step}"
            )

    # ---- state -------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._queue)

    @property
    def version(self) -> int:
        """The trainer's policy version as last told (get_batch or set_version)."""
        return self._version

    @property
    def closed(self) -> bool:
        return self._closed

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait(self, what: str) -> None:
        self._check_open(what)
        await self._changed.wait()
        self._check_open(what)

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise BufferClosed(
                f"rollout buffer closed; cannot {what} ({len(self._queue)} groups buffered)"
            )

    def set_version(self, version: int) -> None:
        """The trainer published `version`; producers held back by throttle may go on."""
        if version < self._version:
            raise ValueError(
                f"policy version went back from {self._version} to {version}; versions rise "
                "by one per trainer step"
            )
        if version > self._version:
            self._version = int(version)
            self._taken_now = 0
            self._notify()

    def close(self) -> None:
        """Wake every waiter with BufferClosed; buffered groups stay for state_dict."""
        self._closed = True
        self._notify()

    # ---- producers ---------------------------------------------------------------------

    def _can_admit(self) -> bool:
        held = len(self._queue) + self._in_flight
        if held >= self.cfg.max_groups:
            return False
        ahead = self._ahead()
        return ahead is None or held + self._taken_now < ahead

    def _ahead(self) -> int | None:
        """With throttle: most groups queued, in flight or taken at the current version."""
        if not self.staleness_cfg.throttle:
            return None
        assert self.groups_per_step is not None
        return (self.staleness_cfg.max_staleness + 1) * self.groups_per_step

    async def reserve(self) -> Reservation:
        """Wait for room for one more group (capacity and, with throttle, the trainer
        catching up), then hold it. BufferClosed if the buffer is or gets closed."""
        start = self._clock()
        try:
            while not self._can_admit():
                await self._wait("reserve a slot")
            self._check_open("reserve a slot")
        finally:
            waited = self._clock() - start
            self._total.put_wait_s += waited
            self._window.put_wait_s += waited
        self._in_flight += 1
        return Reservation()

    def release(self, reservation: Reservation) -> None:
        """Give back a slot whose group will never be put (generation failed)."""
        if reservation.open:
            reservation.open = False
            self._in_flight -= 1
            self._notify()

    async def put(
        self, group: Sequence[Trajectory], reservation: Reservation | None = None
    ) -> None:
        """Queue one scored group, in the slot `reservation` or in one reserved now."""
        min_version = group_min_version(group)
        if reservation is None:
            reservation = await self.reserve()
        elif not reservation.open:
            raise ValueError("this reservation was already used by put or given back")
        reservation.open = False
        self._in_flight -= 1
        if self._closed:
            self._notify()
            self._check_open("put a group")
        self._queue.append(_Entry(self._next_arrival, min_version, list(group)))
        self._next_arrival += 1
        self._notify()

    # ---- the trainer -------------------------------------------------------------------

    def _drop_stale(self) -> None:
        if not self._queue:
            return
        min_versions_Q = np.array([e.min_version for e in self._queue], dtype=np.int64)
        out = self._staleness_fn(StalenessInput(self._version - min_versions_Q, self._version))
        keep_Q = np.asarray(out.keep_Q, dtype=bool)
        if keep_Q.shape != min_versions_Q.shape:
            raise ValueError(
                f"staleness policy returned keep_Q of shape {keep_Q.shape} for "
                f"{len(self._queue)} queued groups"
            )
        if keep_Q.all():
            return
        num_dropped = int((~keep_Q).sum())
        self._total.dropped[out.reason] += num_dropped
        self._window.dropped[out.reason] += num_dropped
        self._queue = [e for e, keep in zip(self._queue, keep_Q) if keep]
        self._notify()

    def _take(self, num_groups: int) -> list[_Entry]:
        min_versions_Q = np.array([e.min_version for e in self._queue], dtype=np.int64)
        arrival_Q = np.array([e.arrival for e in self._queue], dtype=np.int64)
        out = self._sampling_fn(SamplingInput(min_versions_Q, arrival_Q, self._version))
        picked = np.asarray(out.order_Q, dtype=np.int64).reshape(-1)[:num_groups].tolist()
        if len(set(picked)) != num_groups or not all(0 <= i < len(self._queue) for i in picked):
            raise ValueError(
                f"buffer.sampling must order {len(self._queue)} groups as unique indices; "
                f"its first {num_groups} were {picked}"
            )
        taken = [self._queue[i] for i in picked]
        chosen = set(picked)
        self._queue = [e for i, e in enumerate(self._queue) if i not in chosen]
        return taken

    async def get_batch(self, num_groups: int, current_version: int) -> list[Group]:
        """Wait for `num_groups` groups fresh enough for `current_version` and take them in
        the sampling policy's order. Stale groups are dropped on the way."""
        if num_groups < 1 or num_groups > self.cfg.max_groups:
            raise ValueError(
                f"get_batch(num_groups={num_groups}) must ask for 1..buffer.max_groups="
                f"{self.cfg.max_groups} groups"
            )
        self.set_version(current_version)
        ahead = self._ahead()
        if ahead is not None and self._taken_now + num_groups > ahead:
            raise ValueError(
                f"get_batch(num_groups={num_groups}) would take {self._taken_now + num_groups} "
                f"groups at version {self._version}, more than throttle lets producers make "
                f"((staleness.max_staleness + 1) * groups_per_step = {ahead}), so it would "
                "wait forever; advance the version or raise groups_per_step"
            )
        start = self._clock()
        try:
            while True:
                self._check_open(f"get {num_groups} groups")
                self._drop_stale()
                if len(self._queue) >= num_groups:
                    break
                await self._wait(f"get {num_groups} groups")
        finally:
            waited = self._clock() - start
            self._total.get_wait_s += waited
            self._window.get_wait_s += waited
        taken = self._take(num_groups)
        self._taken_now += num_groups
        for counters in (self._total, self._window):
            counters.consumed += num_groups
            counters.staleness.update(self._version - e.min_version for e in taken)
        self._notify()
        return [e.group for e in taken]

    # ---- metrics and checkpoints -------------------------------------------------------

    def metrics(self) -> dict[str, float]:
        """Flat scalars for telemetry. Names without `_total` cover the time since the last
        call (a wait still in progress is counted when it ends)."""
        w, t = self._window, self._total
        hist = w.staleness
        consumed = sum(hist.values())
        out = {
            "buffer/occupancy": len(self._queue) / self.cfg.max_groups,
            "buffer/groups": float(len(self._queue)),
            "buffer/in_flight": float(self._in_flight),
            "buffer/version": float(self._version),
            "buffer/put_wait_s": w.put_wait_s,
            "buffer/put_wait_s_total": t.put_wait_s,
            "buffer/get_wait_s": w.get_wait_s,
            "buffer/get_wait_s_total": t.get_wait_s,
            "buffer/consumed": float(w.consumed),
            "buffer/consumed_total": float(t.consumed),
            "buffer/dropped": float(sum(w.dropped.values())),
            "buffer/dropped_total": float(sum(t.dropped.values())),
            "buffer/staleness_mean": sum(k * n for k, n in hist.items()) / max(consumed, 1),
            "buffer/staleness_max": float(max(hist, default=0)),
        }
        out.update({f"buffer/dropped/{r}": float(n) for r, n in sorted(w.dropped.items())})
        out.update({f"buffer/staleness/{k}": float(n) for k, n in sorted(hist.items())})
        self._window = _Counters()
        return out

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe: queued groups (Trajectory.to_dict), version and cumulative counters.
        Slots held by producers are not saved; their groups are generated again."""
        t = self._total
        return {
            "version": self._version,
            "next_arrival": self._next_arrival,
            "groups": [
                {"arrival": e.arrival, "trajectories": [traj.to_dict() for traj in e.group]}
                for e in self._queue
            ],
            "totals": {
                "put_wait_s": t.put_wait_s,
                "get_wait_s": t.get_wait_s,
                "consumed": t.consumed,
                "dropped": dict(t.dropped),
                "staleness": {str(k): n for k, n in t.staleness.items()},
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what state_dict saved; call before producers and the trainer start."""
        if self._in_flight or self._queue:
            raise RuntimeError("load_state_dict needs an empty buffer with no slots held")
        queue = []
        for g in state["groups"]:
            group = [Trajectory.from_dict(d) for d in g["trajectories"]]
            queue.append(_Entry(int(g["arrival"]), group_min_version(group), group))
        totals = state["totals"]
        self._queue = queue
        self._version = int(state["version"])
        self._next_arrival = int(state["next_arrival"])
        self._taken_now = 0
        self._total = _Counters(
            put_wait_s=float(totals["put_wait_s"]),
            get_wait_s=float(totals["get_wait_s"]),
            consumed=int(totals["consumed"]),
            dropped=Counter({str(r): int(n) for r, n in totals["dropped"].items()}),
            staleness=Counter({int(k): int(n) for k, n in totals["staleness"].items()}),
        )
        self._window = _Counters()
        self._notify()
