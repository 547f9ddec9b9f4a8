"""Held-out evaluation on the rollout loop, concurrent with training (eval.every).

The RolloutService owns one EvalRunner on its event loop. After a step's weight push the
trainer's loop calls ``launch(step, version)``: every set's first eval.num_prompts
prompts get a greedy completion and eval.n samples through the same engine client as the
orchestrator, as a background task beside it, so generation for training and the trainer
go on. When every set is scored, its numbers (moerl.telemetry.eval_metrics, plus
``eval/<set>/version`` and ``eval/<set>/step``) wait in ``pop_metrics()`` for the next
metrics line. A launch while an eval still runs is skipped (counted in eval/skipped).

Eval requests are not training rollouts: they never reach the buffer, the data cursor or
the rollout/ counters, use rids of their own (``moerl-eval-<tag>-...``, so aborting the
orchestrator's prefix never reaches them) and ask for no routes or masks.

Weight updates, per rollout.partial_rollout:
- in_place: eval requests ride through the push like training ones (paused in place
  when in_place_pause); a completion may then span two versions;
- abort_resume: the engines abort every request; aborted eval completions wait for the
  update to end and are generated again from scratch under the new weights;
- drain: the push waits for no eval: before_update aborts the eval requests (and waits
  until they came back), which are then generated again from scratch.
``eval/<set>/version`` is the version at launch, ``version_end`` the one at the end; they
differ when a push landed during the eval. ``stop()`` cancels the eval and aborts its
requests at shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moerl.common.trajectory import Trajectory
from moerl.config.eval import EvalConfig
from moerl.rollout.client import EngineClient
from moerl.rollout.errors import EngineError
from moerl.rollout.faults import abort_prefix
from moerl.rollout.scoring import INLINE_S, RewardRunner, gather_or_cancel
from moerl.telemetry.eval_metrics import PromptResult, set_metrics

if TYPE_CHECKING:
    from moerl.tasks.base import Prompt, Task
    from moerl.telemetry.timeline import Timeline

log = logging.getLogger(__name__)

MAX_REISSUES = 64
"""Times one eval completion is generated again after an abort before the eval fails."""


def eval_sampling(cfg: EvalConfig, rollout_params: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """SGLang sampling_params of the greedy and the sampled eval completions, from the
    rollout's (top_p/top_k/min_p, stop tokens); eval completions end at EOS."""
    base = {k: v for k, v in rollout_params.items() if k != "ignore_eos"}
    if cfg.max_new_tokens:
        base["max_new_tokens"] = cfg.max_new_tokens
    greedy = {**base, "temperature": 0.0, "top_k": 1}
    return {"greedy": greedy, "sampled": {**base, "temperature": cfg.temperature}}


def _distinct_prompts(name: str, task: Task, wanted: int) -> list[Prompt]:
    """The first ``wanted`` prompts of ``task``, but each item once: a set of fewer items
    (a task's finite ``num_items``) is evaluated whole, not cycled, which would count
    repeats as new prompts and skew pass@k; logged once."""
    items = getattr(task, "num_items", None)
    take = wanted if not isinstance(items, int) else min(wanted, items)
    if take < wanted:
        log.warning(
            "eval.sets.%s has %d items, fewer than eval.num_prompts=%d: evaluating each once",
            name, take, wanted,
        )  # fmt: skip
    return list(itertools.islice(task.prompts(0), take))


class EvalRunner:
    """Evaluates held-out sets through ``client``; lives on the rollout loop."""

    def __init__(
        self,
        client: EngineClient,
        sets: Mapping[str, Task],
        cfg: EvalConfig,
        rollout_params: Mapping[str, Any],
        *,
        partial_rollout: str = "in_place",
        reward_workers: int = 4,
        reward_inline_s: float = INLINE_S,
        version: int = 0,
        timeline: Timeline | None = None,
        log_path: Path | None = None,
    ) -> None:
        """``log_path``: one JSON line per finished eval (its step, version and numbers),
        so none is lost when two finish between two metrics lines (``pop_metrics`` then
        reports the newer)."""
        self.client, self.cfg, self.timeline = client, cfg, timeline
        self.log_path = log_path
        self.version = int(version)
        """The policy version the engines serve (after_update)."""
        self._sampling = eval_sampling(cfg, rollout_params)
        self._prompts: dict[str, list[Prompt]] = {
            name: _distinct_prompts(name, task, cfg.num_prompts) for name, task in sets.items()
        }
        for name, prompts in self._prompts.items():
            if not prompts:
                raise ValueError(f"eval.sets.{name}: the task gave no prompts")
        self._rewards = {
            name: RewardRunner(task, reward_workers, reward_inline_s) for name, task in sets.items()
        }
        self._mode = partial_rollout
        self._tag = uuid.uuid4().hex[:8]
        self._gate = asyncio.Event()
        self._gate.set()
        self._slots = asyncio.Semaphore(cfg.max_concurrent)
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._adapter: str | None = None
        self._task: asyncio.Task[None] | None = None
        self._ready: dict[str, float] = {}
        self._counts = {"launched": 0, "done": 0, "skipped": 0, "errors": 0, "reissued": 0}

    @property
    def prefix(self) -> str:
        """The rid prefix of every request of this runner."""
        return f"moerl-eval-{self._tag}-"

    # ---- launching ---------------------------------------------------------------------

    def launch(self, step: int, version: int) -> bool:
        """Start evaluating policy ``version`` (pushed after ``step``) in the background;
        False (and counted as skipped) while the previous eval still runs."""
        if self.running:
            self._counts["skipped"] += 1
            return False
        self._counts["launched"] += 1
        self.version = int(version)
        self._task = asyncio.create_task(self._background(step), name=f"moerl-eval-{step}")
        return True

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def wait(self) -> None:
        """Return once no eval runs (its numbers are then ready)."""
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)

    async def _background(self, step: int) -> None:
        try:
            metrics = await self.evaluate(step)
            self._ready.update(metrics)  # after the await: pop_metrics() swaps the dict
            if self.log_path is not None:
                with self.log_path.open("a", encoding="utf-8") as f:
                    f.write(json.dumps({"step": step, **metrics}) + "\n")
            self._counts["done"] += 1
        except asyncio.CancelledError:
            raise
        except Exception as err:  # an eval must not stop the run; it is counted and logged
            self._counts["errors"] += 1
            log.warning("eval after step %d failed: %s: %s", step, type(err).__name__, err)

    def pop_metrics(self) -> dict[str, float]:
        """The numbers of evals finished since the last call, and the eval counters."""
        out, self._ready = self._ready, {}
        out.update({f"eval/{k}_total": float(v) for k, v in self._counts.items()})
        return out

    # ---- one evaluation ----------------------------------------------------------------

    async def evaluate(self, step: int) -> dict[str, float]:
        """Every set at the current weights; the metrics of all sets."""
        start_version = self.version
        span = (
            self.timeline.span("eval", step=step, version=start_version)
            if self.timeline is not None
            else contextlib.nullcontext()
        )
        out: dict[str, float] = {}
        async with span:
            for name, prompts in self._prompts.items():
                results = await gather_or_cancel(
                    [self._prompt(name, step, p, i) for i, p in enumerate(prompts)]
                )
                out.update(set_metrics(name, results, self.cfg.k, self.cfg.threshold))
                out[f"eval/{name}/version"] = float(start_version)
                out[f"eval/{name}/version_end"] = float(self.version)
                out[f"eval/{name}/step"] = float(step)
        return out

    async def _prompt(self, name: str, step: int, prompt: Prompt, i: int) -> PromptResult:
        rid = f"{self.prefix}{step}-{name}-{i}-"
        coros = []
        if self.cfg.greedy:
            coros.append(self._completion(prompt, self._sampling["greedy"], rid + "g"))
        coros += [
            self._completion(prompt, self._sampling["sampled"], f"{rid}{j}")
            for j in range(self.cfg.n)
        ]
        trajs = await gather_or_cancel(coros)
        rewards = await self._rewards[name].score(prompt, trajs)
        for traj, reward in zip(trajs, rewards):
            traj.reward = reward
        greedy = trajs[0] if self.cfg.greedy else None
        return PromptResult(greedy=greedy, samples=trajs[1:] if self.cfg.greedy else trajs)

    async def _completion(self, prompt: Prompt, params: dict[str, Any], rid: str) -> Trajectory:
        """One completion, generated again from scratch when a weight update aborts it."""
        async with self._slots:
            for attempt in range(MAX_REISSUES + 1):
                while not self._gate.is_set():  # closed again before it ran: wait again
                    await self._gate.wait()
                self._inflight += 1
                self._idle.clear()
                try:
                    traj = await self.client.generate_trajectory(
                        prompt.input_ids, params, rid=f"{rid}a{attempt}",
                        lora_path=self._adapter,
                    )  # fmt: skip
                finally:
                    self._inflight -= 1
                    if not self._inflight:
                        self._idle.set()
                if traj.finish_reason != "abort":
                    traj.meta["prompt_id"] = prompt.prompt_id
                    return traj
                self._counts["reissued"] += 1
        raise EngineError(f"eval request {rid} was aborted {MAX_REISSUES + 1} times")

    # ---- weight updates and shutdown ---------------------------------------------------

    def quiet(self) -> bool:
        """No eval request is on the engines."""
        return self._inflight == 0

    async def before_update(self, hold: bool = False) -> None:
        """Before a push: in abort_resume and drain (and with ``hold``) no eval request
        may start; drain aborts the running ones itself and waits until they came back."""
        if hold:
            self._gate.clear()
        if self._mode not in ("abort_resume", "drain"):
            return
        self._gate.clear()
        if self._mode == "drain" and self._inflight:
            await abort_prefix(self.client, self.prefix)
            await self._idle.wait()

    def after_update(self, version: int, adapter: str | None = None) -> None:
        """Every engine serves ``version`` (LoRA: ``adapter``); eval requests go on."""
        self.version = int(version)
        if adapter is not None:
            self._adapter = adapter
        self._gate.set()

    async def stop(self) -> None:
        """Cancel a running eval and abort its requests on the engines."""
        task, self._task = self._task, None
        self._gate.set()
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await abort_prefix(self.client, self.prefix)
        for runner in self._rewards.values():
            runner.close()
        if self.timeline is not None:
            self.timeline.close()
