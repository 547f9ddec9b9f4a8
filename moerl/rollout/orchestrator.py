"""The rollout orchestrator: prompts in, scored groups into the RolloutBuffer
(docs/architecture.md, "Data flow").

Runs on trainer rank 0 in an event-loop thread (moerl.rollout.aio.EventLoopThread):

    orch = Orchestrator(client, task, buffer, cfg.rollout, num_layers=L, topk=K)
    orch.load_state_dict(ckpt["rollout"])          # when resuming, before run()
    aio.submit(orch.run())                         # until stop(), buffer close or task end
    each step: get_batch ... train ... aio.run(orch.before_update()); weight_sync.push(v);
               aio.run(orch.after_update(v))
    checkpoint: orch.state_dict() and buffer.state_dict() in ONE loop callback
    aio.run(orch.stop())

A group: the prompt at the data cursor, a reserved buffer slot, G = cfg.group_size
completions sampled concurrently, each scored by task.reward off the critical path (sync
rewards in a thread pool, async ones awaited; scoring never holds up another group's
generation), the dynamic filter, `buffer.put(group, slot)`. group_id = the prompt's stream
position, index = 0..G-1, rids "moerl-<run tag>-<position>-<attempt>-<index>[r<k>]".

Over-sampling. At most R = ceil(oversample_factor * max_inflight_groups) groups generate
at once (scoring ones do not count). Launches form consecutive rounds of R groups; once
B = max_inflight_groups groups of a round reached the buffer, the round's other groups
(generating or scoring) are cancelled, their requests aborted and their prompts consumed
(rollout/groups_cancelled): each round keeps the first B groups to finish and pass the
filter. With oversample_factor=1 (R = B) nothing is ever cancelled.

The data cursor (moerl.rollout.cursor). A prompt is settled once its group was put, filtered
or cancelled by over-sampling; `cursor` is the first unsettled position and state_dict()
adds the settled positions beyond it. A run resumed from it generates every unsettled
prompt and no settled one: nothing that reached the buffer is repeated, nothing skipped;
groups in flight at the checkpoint are generated again from scratch.

Weight updates (cfg.partial_rollout): before_update() before the push, after_update(v) once
every engine serves v.
- in_place: completions continue on their KV cache; later tokens carry the new version.
  With cfg.in_place_pause the engines pause in place for the push (no token from
  half-loaded weights; SGLang needs it).
- abort_resume: launches stop, engines abort every request; after the update each aborted
  completion continues from prompt + partial response and is spliced into one trajectory
  (moerl.rollout.partial documents which routes are kept and why). Launches resume.
- drain: launches stop; before_update returns once no group is generating (scoring may go
  on); after_update lets launches resume. No trajectory spans two versions.
In every mode, routes row t was computed under versions[clip(t - P + 1, 0, R - 1)]
(moerl.rollout.partial.route_versions).

Episodes (``episodes``, env != none; moerl.rollout.episode). Each of a group's G members
is an episode played against its own environment (``make_env(prompt)``), giving one
trajectory per role: a group holds G × roles trajectories, scored by the environment
(the task's reward is not called). An episode is generating until it ends, so `drain`
waits for whole episodes; many episodes are in flight and an environment step holds up
only its own episode.

Reward models (``reward_model``, moerl.rollout.reward_model). After the task's reward
(or the environment's), a group is scored by the RM service in its own task (span
"reward_model" in the timeline): batched with other groups' completions, retried there;
a slow RM delays only the groups it scores. An RM that still fails fails the group (the
fault policy below).

Faults. The client re-sends a failed /generate (connection error, timeout, HTTP 5xx) on
another engine and keeps the failed one out for cfg.engine_cooldown_s (build it with
make_client). A group whose request still fails is aborted, its slot released, its prompt
generated again after a backoff; after cfg.max_group_attempts attempts run() raises. Errors
retrying cannot fix (HTTP 4xx, missing routes or mask, an invalid trajectory, a failing
reward) stop run() at once.
"""

# G completions per group, R response tokens

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from moerl.common.trajectory import Trajectory
from moerl.config.rollout import RolloutConfig
from moerl.rollout.buffer import BufferClosed, Reservation, RolloutBuffer
from moerl.rollout.client import EngineClient
from moerl.rollout.cursor import DataCursor, Item
from moerl.rollout.errors import EngineError
from moerl.rollout.faults import abort_prefix, is_fatal, make_client
from moerl.rollout.partial import UpdateGate, sample_completion, sample_group
from moerl.rollout.scoring import RewardRunner, gather_or_cancel, uniform
from moerl.rollout.stats import RolloutStats

if TYPE_CHECKING:
    from moerl.rollout.episode import EpisodeEnv
    from moerl.rollout.reward_model import RewardModel
    from moerl.tasks.base import Prompt, Task
    from moerl.telemetry.timeline import Timeline

__all__ = ["Orchestrator", "make_client"]

log = logging.getLogger(__name__)


@dataclass
class _Round:
    launched: int = 0
    kept: int = 0
    complete: bool = False
    members: set[int] = field(default_factory=set)


@dataclass
class _Flight:
    item: Item
    slot: Reservation
    rid: str
    round: _Round
    task: asyncio.Task[None] | None = None
    cancel_reason: str | None = None


class Orchestrator:
    """Keeps groups generating into the buffer; see the module docstring."""

    def __init__(
        self,
        client: EngineClient,
        task: Task,
        buffer: RolloutBuffer,
        cfg: RolloutConfig,
        *,
        num_layers: int,
        topk: int,
        start_cursor: int = 0,
        timeline: Timeline | None = None,
        episodes: EpisodeEnv | None = None,
        reward_model: RewardModel | None = None,
    ) -> None:
        """num_layers / topk: the model's num_hidden_layers and experts per token (shape of
        the routes). start_cursor: the first prompt position to generate. episodes: the
        environment every group member is an episode of (None: single completions).
        reward_model: scores each group after the task's reward (None: none)."""
        from omegaconf import DictConfig, OmegaConf

        if isinstance(cfg, DictConfig):
            cfg = OmegaConf.to_object(cfg)  # type: ignore[assignment]
        cfg.validate("rollout")
        self.client, self.task, self.buffer, self.cfg = client, task, buffer, cfg
        self.num_layers, self.topk, self.timeline = num_layers, topk, timeline
        self.version: int | None = None
        """The version passed to the last after_update."""
        self._sampling = cfg.sampling_params()
        self._adapter: tuple[str, int] | None = None  # LoRA: (engine adapter name, version)
        self._rewards = RewardRunner(task, cfg.reward_workers, cfg.reward_inline_us * 1e-6)
        self._reward_model = reward_model
        self._tag = uuid.uuid4().hex[:8]
        self._data = DataCursor(task, start_cursor)
        self._flights: dict[int, _Flight] = {}
        self._generating = 0
        self._round = _Round()
        self._launcher: asyncio.Task[None] | None = None
        self._error: BaseException | None = None
        self._stopping = False
        self._gate = UpdateGate(
            client, cfg.partial_rollout, cfg.in_place_pause, partial(self._count, "control_errors")
        )
        self._changed = asyncio.Event()
        self._stats = RolloutStats(getattr(client, "retries", 0))
        self._episodes = None
        if episodes is not None:
            self._episodes = episodes.runner(
                client, self._sampling, cfg, num_layers, topk, self._gate.engines_open
            )

    # ---- state -----------------------------------------------------------------------

    @property
    def cursor(self) -> int:
        """Position of the first prompt not yet settled (put, filtered or cancelled)."""
        return self._data.cursor

    @property
    def generating(self) -> int:
        """Groups whose completions are being generated now."""
        return self._generating

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe: the cursor and the settled positions beyond it (moerl.rollout.cursor)."""
        return self._data.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a state_dict's cursor, skipping its settled positions; before run()."""
        if self._launcher is not None:
            raise RuntimeError("load_state_dict must be called before run()")
        self._data.load_state_dict(state)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # ---- the launch loop -------------------------------------------------------------

    async def run(self) -> None:
        """Generate until stop(), the buffer closes or the task runs out of prompts (then
        return once every group settled). Raises the first error a retry cannot fix."""
        if self._launcher is not None:
            raise RuntimeError("Orchestrator.run() may be called once")
        self._launcher = asyncio.create_task(self._launch_loop(), name="moerl-launcher")
        try:
            await self._launcher
        except asyncio.CancelledError:
            if self._error is None and not self._stopping:  # run() itself was cancelled
                await self.stop()
                raise
        except BaseException as err:  # the task's prompt stream failed
            self._error = self._error or err
        if not self._stopping:
            await self.stop()
        if self._error is not None:
            raise self._error

    async def _launch_loop(self) -> None:
        limit = self.cfg.groups_per_round
        while True:
            while self._generating >= limit:
                await self._changed.wait()
            item = self._data.next()
            if item is None:
                if not self._flights:
                    return
                await self._changed.wait()
                continue
            try:
                slot = await self.buffer.reserve()
            except BufferClosed:
                self._data.retry(item)
                return  # the trainer is done: nothing more to generate
            except BaseException:
                self._data.retry(item)
                raise
            try:  # woken, then closed again by the next update before it ran: wait again
                while not self._gate.launch_open.is_set():
                    await self._gate.launch_open.wait()
            except BaseException:
                self.buffer.release(slot)
                self._data.retry(item)
                raise
            self._start(item, slot, limit)

    def _start(self, item: Item, slot: Reservation, limit: int) -> None:
        if self._round.complete or self._round.launched >= limit:
            self._round = _Round()
        self._round.launched += 1
        self._round.members.add(item.pos)
        rid = f"moerl-{self._tag}-{item.pos}-{item.attempt}"
        flight = _Flight(item, slot, rid, self._round)
        self._flights[item.pos] = flight
        self._generating += 1
        flight.task = asyncio.create_task(self._run_group(flight), name=rid)
        flight.task.add_done_callback(partial(self._group_done, flight))

    def _group_done(self, flight: _Flight, task: asyncio.Task[None]) -> None:
        if self._flights.get(flight.item.pos) is flight:
            del self._flights[flight.item.pos]
        self._notify()
        if task.cancelled():
            return
        err = task.exception()
        if err is not None and self._error is None:
            self._error = err
            if self._launcher is not None and not self._launcher.done():
                self._launcher.cancel()

    # ---- one group -------------------------------------------------------------------

    async def _run_group(self, flight: _Flight) -> None:
        item = flight.item
        assert item.prompt is not None
        try:
            start = time.perf_counter()
            span = (
                self.timeline.span("generate", group=item.pos, attempt=item.attempt)
                if self.timeline is not None
                else contextlib.nullcontext()
            )
            try:
                async with span as s:
                    if self._one_request():
                        members = [await self._completion_group(item.prompt, flight)]
                    else:
                        member = self._completion if self._episodes is None else self._episode
                        members = await gather_or_cancel(
                            [member(item.prompt, flight, i) for i in range(self.cfg.group_size)]
                        )
                    group = [t for m in members for t in m]
                    if s is not None:
                        s.attrs["tokens"] = sum(t.response_len for t in group)
            except asyncio.CancelledError:
                if not self._stopping:  # stop() aborts all of this run's requests at once
                    await abort_prefix(self.client, flight.rid + "-")
                raise
            finally:
                self._generating -= 1
                self._count("gen_s", time.perf_counter() - start)
                self._notify()
            # the prompts that go next, made while the engines still generate: a
            # synchronous step's launch then only posts them
            self._data.prefetch(self.cfg.groups_per_round)
            await self._score_and_put(item, group, flight)
        except asyncio.CancelledError:
            self.buffer.release(flight.slot)
            if flight.cancel_reason == "oversample":
                self._data.settle(item.pos)
                self._count("cancelled")
            raise
        except BufferClosed:
            self.buffer.release(flight.slot)
        except BaseException as err:
            self.buffer.release(flight.slot)
            if is_fatal(err):
                raise
            await self._requeue(flight, err)

    async def _episode(self, prompt: Prompt, flight: _Flight, index: int) -> list[Trajectory]:
        assert self._episodes is not None
        adapter = self._adapter
        trajs, stats = await self._episodes.run(
            prompt, group_id=flight.item.pos, index=index, rid=f"{flight.rid}-{index}",
            lora_path=adapter[0] if adapter else None,
        )  # fmt: skip
        for traj in trajs:
            if adapter is not None:  # as _completion: the adapter is the version
                traj.versions[:] = adapter[1]
            self._stats.role(str(traj.role), float(traj.reward or 0.0))
        spans = {int(v) for t in trajs for v in np.unique(t.versions)}
        for name, value in (
            ("episodes", 1), ("turns", stats.turns), ("env_s", stats.env_s),
            ("env_steps", stats.env_steps), ("tool_calls", stats.tool_calls),
            ("tool_errors", stats.tool_errors), ("resumed", stats.retried_turns),
            ("turn_versions", len(spans)),
        ):  # fmt: skip
            self._count(name, value)
        return trajs

    async def _completion(self, prompt: Prompt, flight: _Flight, index: int) -> list[Trajectory]:
        sampling = self._sampling
        length = self.cfg.completion_length(flight.item.pos, index)
        if length is not None:  # a drawn length (cfg.length_distribution), EOS or not
            sampling = {**sampling, "max_new_tokens": length, "ignore_eos": True}
        adapter = self._adapter
        traj = await sample_completion(
            self.client,
            prompt.input_ids,
            sampling,
            routed_experts=self.cfg.return_routed_experts,
            sampling_mask=self.cfg.records_sampling_mask(),
            num_layers=self.num_layers,
            topk=self.topk,
            group_id=flight.item.pos,
            index=index,
            rid=f"{flight.rid}-{index}",
            gate=self._gate.engines_open,
            on_resume=partial(self._count, "resumed"),
            lora_path=adapter[0] if adapter else None,
        )
        if adapter is not None:
            # the base weights never change under LoRA: the adapter a request ran with is
            # its policy version (it keeps that adapter to the end, whatever loads meanwhile)
            traj.versions[:] = adapter[1]
        traj.meta["prompt_id"] = prompt.prompt_id
        return [traj]

    def _one_request(self) -> bool:
        """Whether a group goes to the engines as one /generate with n (rollout.group_request)."""
        return (
            self.cfg.group_request
            and self._episodes is None
            and self.cfg.length_distribution == "fixed"
            and self.cfg.group_size > 1
        )

    async def _completion_group(self, prompt: Prompt, flight: _Flight) -> list[Trajectory]:
        """The group's completions as one request (see _one_request); as _completion's."""
        adapter = self._adapter
        trajs = await sample_group(
            self.client,
            prompt.input_ids,
            self._sampling,
            self.cfg.group_size,
            routed_experts=self.cfg.return_routed_experts,
            sampling_mask=self.cfg.records_sampling_mask(),
            num_layers=self.num_layers,
            topk=self.topk,
            group_id=flight.item.pos,
            rid=flight.rid,
            gate=self._gate.engines_open,
            on_resume=partial(self._count, "resumed"),
            lora_path=adapter[0] if adapter else None,
        )
        for traj in trajs:
            if adapter is not None:  # as _completion
                traj.versions[:] = adapter[1]
            traj.meta["prompt_id"] = prompt.prompt_id
        return trajs

    def set_adapter(self, name: str, version: int) -> None:
        """LoRA runs: completions started from now on use adapter ``name`` (policy
        ``version``) on the engines."""
        self._adapter = (name, int(version))

    async def _score_and_put(self, item: Item, group: list[Trajectory], flight: _Flight) -> None:
        assert item.prompt is not None
        start = time.perf_counter()
        if self._episodes is None:
            for traj, reward in zip(group, await self._rewards.score(item.prompt, group)):
                traj.reward = reward
        if self._reward_model is not None:
            span = (
                self.timeline.span("reward_model", group=item.pos, attempt=item.attempt)
                if self.timeline is not None
                else contextlib.nullcontext()
            )
            async with span:
                await self._reward_model.score(item.prompt, group)
        rewards = [float(t.reward or 0.0) for t in group]
        self._count("score_s", time.perf_counter() - start)
        self._count("tokens", sum(t.response_len for t in group))
        self._count("completions", len(group))
        self._count("reward_sum", sum(rewards))
        if self.cfg.filter_uniform_groups and uniform(rewards):
            self.buffer.release(flight.slot)
            self._data.settle(item.pos)
            self._count("filtered")
            return
        await self.buffer.put(group, flight.slot)
        self._data.settle(item.pos)
        self._count("done")
        rnd = flight.round
        rnd.kept += 1
        if rnd.kept >= self.cfg.max_inflight_groups and not rnd.complete:
            rnd.complete = True
            for pos in rnd.members:
                other = self._flights.get(pos)
                if other is not None and other is not flight and other.round is rnd:
                    assert other.task is not None
                    other.cancel_reason = "oversample"
                    other.task.cancel()

    async def _requeue(self, flight: _Flight, err: BaseException) -> None:
        item = flight.item
        self._count("failures")
        flight.round.members.discard(item.pos)
        await abort_prefix(self.client, flight.rid + "-")
        if item.attempt + 1 >= self.cfg.max_group_attempts:
            raise EngineError(
                f"prompt {item.pos} failed {item.attempt + 1} times "
                f"(rollout.max_group_attempts={self.cfg.max_group_attempts}); last error: {err}"
            ) from err
        backoff = min(self.cfg.group_retry_backoff_s * 2**item.attempt, 30.0)
        log.warning("group %d failed (%s); generating it again in %.1f s", item.pos, err, backoff)
        await asyncio.sleep(backoff)
        self._data.retry(Item(item.pos, item.attempt + 1, item.prompt))

    # ---- weight updates --------------------------------------------------------------

    def pauses_in_place(self, atomic: bool = False) -> bool:
        """Whether a push pauses the engines in place (and a quiet one holds instead);
        ``atomic``: every engine loads it at once (moerl.rollout.partial.UpdateGate)."""
        return self._gate.pauses_in_place(atomic)

    async def before_update(self, others_quiet: bool = True, atomic: bool = False) -> None:
        """Await before the trainer pushes new weights to the engines. ``others_quiet``:
        no other request of the run (evaluation) is on the engines either; ``atomic``:
        every engine loads the push at once, between two of its decode steps."""
        quiet = others_quiet and self._generating == 0
        await self._gate.before(self._wait_idle, quiet=quiet, atomic=atomic)

    async def after_update(self, version: int) -> None:
        """Await once every engine serves `version`; generation goes on."""
        self.version = int(version)
        await self._gate.after()

    async def sent(self, turns: int = 64) -> None:
        """Return once the groups the launcher can start now have sent their first
        request: after one turn of the event loop (the launcher's, which starts every
        group there is room for without waiting), once the client counts as many
        requests outstanding as groups generate, at most ``turns`` turns later. A
        request on a kept connection goes out in its group's first turn. The
        synchronous loop's trainer thread waits for this after a push before its step's
        bookkeeping, whose Python (~0.6 ms of a tiny model's step) otherwise holds the
        interpreter while the requests wait to be written."""
        await asyncio.sleep(0)
        for _ in range(turns):
            if sum(self.client.outstanding.values()) >= self._generating:
                return
            await asyncio.sleep(0)

    async def _wait_idle(self) -> None:
        while self._generating:
            await self._changed.wait()

    # ---- stop and metrics ------------------------------------------------------------

    async def stop(self) -> None:
        """Cancel in-flight groups (aborting their requests on the engines, releasing their
        slots) and the launch loop; run() then returns. Their prompts stay unsettled."""
        self._stopping = True
        self._gate.open()
        tasks = [f.task for f in self._flights.values() if f.task is not None]
        had_requests = self._generating > 0
        launcher = self._launcher
        if launcher is not None and launcher is not asyncio.current_task():
            tasks.append(launcher)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if had_requests:
            await abort_prefix(self.client, f"moerl-{self._tag}-")
        self._rewards.close()
        if self._reward_model is not None:
            await self._reward_model.aclose()

    def _count(self, name: str, value: float = 1) -> None:
        self._stats.count(name, value)

    def metrics(self) -> dict[str, float]:
        """Flat scalars (moerl.rollout.stats); names without `_total` cover the time since
        the last call: rollout/groups_done, groups_filtered, groups_cancelled,
        group_failures, retries, resumed, tokens, gen_s, score_s, reward_mean, ..."""
        out = self._stats.report(
            generating=self._generating,
            cursor=self._data.cursor,
            client_retries=getattr(self.client, "retries", 0),
        )
        if self._reward_model is not None:  # reward_model/latency_s, retries, failures, ...
            out.update(self._reward_model.metrics())
        return out
