"""Rank 0's rollout side as one object: the asyncio thread and everything on it.

The :class:`RolloutService` owns the event-loop thread, the engine client, the task, the
bounded RolloutBuffer, the Orchestrator that keeps generating into it and the
EngineSupervisor that restarts engines. The trainer's loop talks to it in a few calls:

- ``start(on_restart)`` — generation and supervision begin (``on_restart`` is the
  publisher's ``restore``, run when an engine was restarted);
- ``next_batch(version)`` — the next step's trajectories, waiting on the batch and on
  the orchestrator's and supervisor's failure together (whichever comes first); None
  when a restarted engine waits for the current weights first (the trainer pushes
  them, then asks again);
- ``before_update(pauses)`` / ``after_update(publication, rejoined)`` — the bracket of
  a policy push: engines checked (True when restarted ones need the weight group
  rebuilt), the partial-rollout policy applied, new requests switched to the new
  version or adapter, restarted engines released;
- ``start_eval(step, version)`` — held-out evaluation in the background, when
  eval.every is on (moerl.rollout.evaluation); its numbers join ``metrics()``;
- ``state()`` (what a checkpoint keeps), ``metrics()``, ``close()``.

Only rank 0 builds one; the components on its thread never see the trainer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from moerl.common.trajectory import Trajectory
from moerl.config.schema import MoerlConfig
from moerl.config.threads import overlapped
from moerl.rollout.aio import EventLoopThread

T = TypeVar("T")
log = logging.getLogger(__name__)


class RolloutService:
    def __init__(
        self,
        cfg: MoerlConfig,
        *,
        hf_dir: Path,
        run_dir: Path,
        engine_urls: list[str],
        engines: list[Any],
        reward_urls: list[str] | None = None,
        version: int,
        progress: dict[str, Any],
        groups_per_step: int,
        tokenizer: Any = None,
    ) -> None:
        """Connect to the engines (waits until they are healthy) and build the buffer and
        orchestrator at ``version`` (scoring with the reward model at ``reward_urls`` when
        ``reward_model.enabled``), resuming from a checkpoint's ``progress`` record
        (cursor, buffer, orchestrator) when it has one. Nothing generates until start().
        ``tokenizer``: ``hf_dir``'s, when the caller loaded it already (None: loaded here)."""
        from moerl.models.tokenizer import load_tokenizer
        from moerl.rollout.faults import make_client
        from moerl.tasks import build_task

        self.cfg, self.engine_urls, self.engines = cfg, engine_urls, engines
        self.groups_per_step = groups_per_step
        self.aio = EventLoopThread("moerl-rollout")
        self._futures: dict[str, concurrent.futures.Future[None]] = {}
        # next_batch's batch in the gathering: (version, future), kept across a push
        self._batch: tuple[int, concurrent.futures.Future[list[Any]]] | None = None
        self.supervisor: Any = None
        self._engines_frozen = False  # freeze_engines_gc ran: restarted engines freeze too
        self.orchestrator: Any = None
        self.buffer: Any = None
        self.client: Any = None
        self.evals: Any = None
        self._taken: dict[str, float] | None = None  # metrics before_update took
        # colocation's sleeps: totals over the run (engine/sleep_* metrics)
        self._sleep = {"slept": 0, "skipped": 0, "seconds": 0.0}
        self._asleep: set[str] = set()
        try:
            from moerl.engine.inprocess import engine_mounts

            mounts = engine_mounts(engines)  # in-process engines: reached without a socket
            self.client = self.aio.run(_call(make_client, engine_urls, cfg.rollout, mounts=mounts))
            self.aio.run(self.client.wait_until_healthy(cfg.engine.startup_timeout_s))
            tokenizer = load_tokenizer(hf_dir) if tokenizer is None else tokenizer
            task = build_task(cfg.task, tokenizer)
            episodes = _episodes(cfg, tokenizer)
            rm = _reward_model(cfg, tokenizer, reward_urls or [])
            self.aio.run(_call(self._build, task, run_dir, version, progress, episodes, rm))
            if cfg.eval.enabled:
                self.evals = self.aio.run(
                    _call(_evals, cfg, self.client, tokenizer, run_dir, version)
                )
        except BaseException:
            self.close()
            raise

    def _build(
        self,
        task: Any,
        run_dir: Path,
        version: int,
        progress: dict[str, Any],
        episodes: Any,
        reward_model: Any,
    ) -> None:
        from moerl.rollout.buffer import RolloutBuffer
        from moerl.rollout.orchestrator import Orchestrator
        from moerl.telemetry.timeline import Timeline

        cfg = self.cfg
        self.buffer = RolloutBuffer(
            cfg.buffer, cfg.staleness, groups_per_step=self.groups_per_step, version=version
        )
        if progress.get("buffer"):
            self.buffer.load_state_dict(progress["buffer"])
        self.orchestrator = Orchestrator(
            self.client, task, self.buffer, cfg.rollout, num_layers=cfg.model.num_layers,
            topk=cfg.model.moe_router_topk, start_cursor=int(progress.get("cursor", 0)),
            timeline=Timeline(run_dir, "rollout") if cfg.telemetry.timeline else None,
            episodes=episodes, reward_model=reward_model() if reward_model else None,
        )  # fmt: skip
        if progress.get("orchestrator"):
            self.orchestrator.load_state_dict(progress["orchestrator"])

    # ---- the event loop, for the publisher --------------------------------------------

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the rollout loop (where the client lives)."""
        return self.aio.submit(coro)

    # ---- run ---------------------------------------------------------------------------

    def start(self, on_restart: Callable[[str], Awaitable[bool]] | None = None) -> None:
        """Generation and engine supervision begin. With launcher.gc_freeze, an engine
        restarted after ``freeze_engines_gc`` is frozen again once ``on_restart`` ran."""
        from moerl.rollout.supervisor import EngineSupervisor

        if on_restart is not None and self.cfg.launcher.gc_freeze:
            on_restart = self._refreezing(on_restart)

        eng = self.cfg.engine
        self._futures["orchestrator"] = self.aio.submit(self.orchestrator.run())
        self.supervisor = self.aio.run(
            _call(
                lambda: EngineSupervisor(
                    self.client,
                    self.engine_urls,
                    self.engines,
                    interval_s=eng.health_interval_s,
                    max_failures=eng.max_health_failures,
                    max_restarts=eng.max_restarts,
                    on_restart=on_restart,
                )  # fmt: skip
            )
        )
        self._futures["supervisor"] = self.aio.submit(self.supervisor.run())

    def freeze_engines_gc(self) -> None:
        """SGLang's /freeze_gc on every engine (moerl/common/gc_freeze.py), after the run's
        first step; a failure is logged, not raised (the run goes on, only slower)."""
        self._engines_frozen = True
        try:
            answers = self.aio.run(self.client.freeze_gc())
        except Exception as err:
            log.warning("could not freeze the engines' garbage collectors: %s", err)
        else:
            log.info("froze the garbage collectors of the engines: %s", ", ".join(answers))

    def _refreezing(
        self, on_restart: Callable[[str], Awaitable[bool]]
    ) -> Callable[[str], Awaitable[bool]]:
        async def restored(url: str) -> bool:
            ready = await on_restart(url)
            if self._engines_frozen:
                try:
                    await self.client.freeze_gc(urls=[url])
                except Exception as err:
                    log.warning("could not freeze the garbage collector of %s: %s", url, err)
                else:
                    log.info("froze the garbage collector of the restarted engine %s", url)
            return ready

        return restored

    def next_batch(self, version: int) -> list[Trajectory] | None:
        """The next ``groups_per_step`` groups' trajectories for the trainer at policy
        ``version``; raises at once if the orchestrator or the supervisor stops first.

        None when, before the batch is complete, a restarted engine waits for the
        current weights: it would wait for the push after this step, and this step for
        its tokens (with one engine, forever). The caller pushes the weights and asks
        again; the batch being gathered is kept for that call (same ``version``)."""
        if self._batch is None:
            self._batch = (
                version, self.aio.submit(self.buffer.get_batch(self.groups_per_step, version))
            )  # fmt: skip
        elif self._batch[0] != version:
            raise RuntimeError(
                f"next_batch(version={version}) while the batch for version "
                f"{self._batch[0]} is still gathered (push the weights and ask again)"
            )
        batch = self._batch[1]
        wants = self.aio.submit(self.supervisor.wants_weights())
        waiting = {batch, wants, *self._futures.values()}
        try:
            while not batch.done():
                done, _ = concurrent.futures.wait(
                    waiting, return_when=concurrent.futures.FIRST_COMPLETED
                )
                for role, fut in self._futures.items():
                    if fut in done and not batch.done():
                        batch.cancel()
                        self._batch = None
                        fut.result()  # its error, if it failed
                        raise RuntimeError(f"the {role} stopped before the run ended")
                if wants in done and not batch.done():
                    return None
        finally:
            wants.cancel()
        self._batch = None
        return [t for group in batch.result() for t in group]

    def before_update(
        self, pauses_generation: bool, atomic: bool = False, take_metrics: bool = False
    ) -> bool:
        """Before a push: every engine checked and restarts waited for; generation
        paused by the partial-rollout policy when the push disturbs requests (``atomic``:
        every engine loads it at once, between two of its decode steps, which
        rollout.in_place_pause='auto' does not pause for). True when engines were
        restarted and the weight group must be built again. One hand-off to the loop;
        ``take_metrics``: the rollout side's metrics are taken in it too, and the next
        ``metrics()`` returns them (without a hand-off of its own)."""

        async def before() -> bool:
            if take_metrics:
                self._taken = await self._gather_metrics()
            rejoin = bool(await self.supervisor.before_push())
            if pauses_generation:
                await self._before_update(atomic)
            return rejoin

        return self.aio.run(before())

    def engines_restarted(self) -> bool:
        """After a push failed: every engine probed, a dead one restarted and waited for
        (``EngineSupervisor.after_failed_push``); True when one was restarted since the
        last push (the weight group must be built again)."""
        return bool(self.aio.run(self.supervisor.after_failed_push()))

    def quiet_for_push(self) -> bool:
        """Whether a push may be announced now (``Publisher.announce``): no eval request
        is on the engines (one sent after the announcement would wait for the next
        version's weights) and no engine is being restarted."""
        return (self.evals is None or self.evals.quiet()) and not self.restart_seen()

    def restart_seen(self) -> bool:
        """Without checking the engines now: whether one is being restarted or was since
        the last push (the weight group must be built again first). A push sent while
        the trainer steps on (sync.overlap) asks this before it starts; an engine dying
        unseen fails that push, and the next one rejoins."""
        return self.supervisor.needs_reconnect or self.supervisor.restarting

    async def _before_update(self, atomic: bool = False) -> None:
        """On the loop, so nothing starts between the look and the gates: with no request
        on the engines (the synchronous loop) the gates close and the engines are not
        paused; else no eval request starts first, then generation pauses."""
        evals_quiet = self.evals is None or self.evals.quiet()
        if self.evals is not None:
            hold = evals_quiet and self.orchestrator.pauses_in_place(atomic)
            await self.evals.before_update(hold=hold)
        await self.orchestrator.before_update(others_quiet=evals_quiet, atomic=atomic)

    def after_update(
        self, version: int, *, paused: bool, adapter: str | None = None, rejoined: bool = False
    ) -> None:
        """After a push of ``version``: generation resumes (``paused``), new requests use
        ``adapter`` (LoRA) and restarted engines that got the weights are released. One
        hand-off to the loop; in the synchronous loop it returns once the next step's
        groups sent their requests (``Orchestrator.sent``)."""
        self.aio.run(self._after_push(version, paused, adapter, rejoined))

    def start_after_update(
        self, version: int, *, paused: bool, adapter: str | None = None, rejoined: bool = False
    ) -> concurrent.futures.Future[None]:
        """``after_update`` without waiting for it: its future. A push whose engines
        hold the requests that arrive while it loads starts it once its last bucket is
        off the wire (``Publisher.early_ready``), so the next step's requests are on
        their way while the engines load the bucket and answer."""
        return self.aio.submit(self._after_push(version, paused, adapter, rejoined))

    def _after_push(
        self, version: int, paused: bool, adapter: str | None, rejoined: bool
    ) -> Coroutine[Any, Any, None]:
        return self._after(
            version, paused=paused, adapter=adapter, rejoined=rejoined,
            launched=not overlapped(self.cfg.staleness),
        )  # fmt: skip

    def after_landing(
        self,
        landing: concurrent.futures.Future[Any],
        version: int,
        *,
        paused: bool,
        rejoined: bool = False,
    ) -> concurrent.futures.Future[Any]:
        """``after_update`` once ``landing`` (a push still completing on the loop, the
        future of its ``Publication``) has landed, without waiting for either: returns
        the future of that ``Publication``. A push that fails there resumes generation
        on ``version - 1`` (what the engines had) and the future holds its error."""

        async def after() -> Any:
            try:
                pub = await asyncio.wrap_future(landing)
            except BaseException:
                # the trainer may already have asked for its next batch (buffer version)
                await self._after(version - 1, paused=paused, buffer=False)
                raise
            await self._after(version, paused=paused, adapter=pub.adapter, rejoined=rejoined)
            return pub

        return self.aio.submit(after())

    async def _after(
        self,
        version: int,
        *,
        paused: bool,
        adapter: str | None = None,
        rejoined: bool = False,
        buffer: bool = True,
        launched: bool = False,
    ) -> None:
        if adapter is not None:
            self.orchestrator.set_adapter(adapter, version)
        if paused:
            await self.orchestrator.after_update(version)
        if self.evals is not None:
            self.evals.after_update(version, adapter)
        if rejoined:
            await self.supervisor.reconnected()
        if buffer:
            self.buffer.set_version(version)
            if launched:
                await self.orchestrator.sent()

    # ---- colocation: the engine sleeps while the trainer steps ------------------------

    def sleep_engines(self, tags: list[str]) -> bool:
        """Have the engines free ``tags`` (SGLang's /release_memory_occupation) while the
        trainer steps; False, with nothing released, when an engine was not idle (a
        request still running: it is counted, and training goes on beside it)."""
        from moerl.rollout.errors import EngineError

        t0 = time.perf_counter()
        try:
            self.aio.run(self.client.release_memory_occupation(tags))
        except EngineError as err:
            if err.status_code != 400:
                raise
            self._sleep["skipped"] += 1
            return False
        finally:
            self._sleep["seconds"] += time.perf_counter() - t0
        self._sleep["slept"] += 1
        self._asleep = set(tags)
        return True

    def wake_engines(self, tags: list[str] | None = None) -> None:
        """Give back what ``sleep_engines`` freed (``tags``: these only; None: all)."""
        wake = sorted(self._asleep if tags is None else self._asleep & set(tags))
        if not wake:
            return
        t0 = time.perf_counter()
        self.aio.run(self.client.resume_memory_occupation(wake))
        self._sleep["seconds"] += time.perf_counter() - t0
        self._asleep -= set(wake)

    def start_eval(self, step: int, version: int, *, final: bool = False) -> None:
        """Evaluate policy ``version`` (just pushed after ``step``) in the background;
        ``final``: wait for a running eval first (the last step always evaluates)."""
        if self.evals is None:
            return
        if final:
            self.aio.run(self.evals.wait())
        self.aio.run(_call(self.evals.launch, step, version))

    # ---- state, metrics, close --------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the rollout side: the data cursor, the buffer's
        groups and the orchestrator's settled positions."""

        def read() -> dict[str, Any]:
            return {
                "cursor": int(self.orchestrator.cursor),
                "buffer": self.buffer.state_dict(),
                "orchestrator": self.orchestrator.state_dict(),
            }

        return self.aio.run(_call(read))

    def metrics(self, wait_eval: bool = False) -> dict[str, float]:
        """The rollout side's metrics since the last call, with the numbers of evals
        finished meanwhile (``wait_eval``: of the running one too, for the last step);
        those ``before_update(take_metrics=True)`` took, if it did since."""
        taken, self._taken = self._taken, None
        if taken is None:  # one hand-off: the loop may be starting the next step's requests
            out = self.aio.run(self._gather_metrics(wait_eval))
        elif wait_eval and self.evals is not None:  # the running eval's, with the taken
            out = {**taken, **self.aio.run(self._eval_metrics(wait=True))}
        else:
            out = taken
        if self.supervisor is not None:
            out.update(self.supervisor.metrics())
        if self._sleep["slept"] or self._sleep["skipped"]:
            out.update({f"engine/sleep_{k}": float(v) for k, v in self._sleep.items()})
        return out

    async def _gather_metrics(self, wait_eval: bool = False) -> dict[str, float]:
        """On the loop: the evals', buffer's and orchestrator's metrics since they were
        last taken."""
        got = await self._eval_metrics(wait_eval)
        got.update(self.buffer.metrics())
        got.update(self.orchestrator.metrics())
        return got

    async def _eval_metrics(self, wait: bool = False) -> dict[str, float]:
        """On the loop: the numbers of the evals finished since they were last taken
        (``wait``: of the running one too)."""
        if self.evals is None:
            return {}
        if wait:
            await self.evals.wait()
        return dict(self.evals.pop_metrics())

    def stop_generation(self) -> None:
        """Stop supervision and generation (no request outlives the run); the event loop
        keeps running for the publisher's last calls until close()."""
        supervisor, orchestrator, evals = self.supervisor, self.orchestrator, self.evals
        self.supervisor = self.orchestrator = self.evals = None
        try:
            if evals is not None:
                self.aio.run(evals.stop(), timeout=60)
            if supervisor is not None:
                self.aio.run(_call(supervisor.stop))
        finally:
            if orchestrator is not None:
                self.aio.run(orchestrator.stop(), timeout=60)

    def close(self) -> None:
        """Stop supervision and generation, close the buffer and the client, stop the
        thread. Safe after a partial start, and after stop_generation()."""
        try:
            self.stop_generation()
            if self.buffer is not None:
                self.aio.run(_call(self.buffer.close))
            if self.client is not None:
                self.aio.run(self.client.aclose())
        finally:
            self.aio.stop()


def _episodes(cfg: MoerlConfig, tokenizer: Any) -> Any:
    """The environment side of the run's episodes (moerl.rollout.episode.EpisodeEnv);
    None for single-turn rollouts (env=none)."""
    from moerl.envs import build_env_factory
    from moerl.rollout.episode import EpisodeEnv
    from moerl.rollout.render import Renderer

    make_env = build_env_factory(cfg.env)
    if make_env is None:
        return None
    env = cfg.env
    return EpisodeEnv(
        make_env=make_env,
        renderer=Renderer(tokenizer, env.renderer),
        max_turns=env.max_turns,
        max_tokens=env.max_episode_tokens or cfg.model.max_position_embeddings,
    )


def _reward_model(cfg: MoerlConfig, tokenizer: Any, urls: list[str]) -> Any:
    """A factory of the run's RewardModel (built on the rollout loop, where its HTTP client
    lives); None without one."""
    if not cfg.reward_model.enabled:
        return None
    from functools import partial

    from moerl.rollout.reward_model import RewardModel

    return partial(RewardModel, cfg.reward_model, tokenizer, urls or list(cfg.reward_model.urls))


def _evals(cfg: MoerlConfig, client: Any, tokenizer: Any, run_dir: Path, version: int) -> Any:
    """The held-out sets' EvalRunner (moerl.rollout.evaluation), built on the loop."""
    from moerl.rollout.evaluation import EvalRunner
    from moerl.tasks import build_task
    from moerl.telemetry.timeline import Timeline

    sets = {
        name: build_task(spec, tokenizer) for name, spec in cfg.eval.resolve_sets(cfg.task).items()
    }
    return EvalRunner(
        client, sets, cfg.eval, cfg.rollout.sampling_params(),
        partial_rollout=cfg.rollout.partial_rollout, reward_workers=cfg.rollout.reward_workers,
        reward_inline_s=cfg.rollout.reward_inline_us * 1e-6, version=version,
        timeline=Timeline(run_dir, "eval") if cfg.telemetry.timeline else None,
        log_path=Path(run_dir) / "eval.jsonl",
    )  # fmt: skip


async def _call(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run a plain function on the rollout loop's thread (its components are not
    thread-safe)."""
    return fn(*args, **kwargs)
