"""The asynchronous RL loop, run by every trainer rank.

Rank 0 owns the rollout side (``moerl.rollout.service.RolloutService``: the engine
client, the bounded buffer and the orchestrator, which keeps generating while the
trainer learns, and the engine supervisor) and the run log. Each step, rank 0 takes a
batch of groups from the buffer (the only place the trainer can wait on generation:
that wait is the trainer's idle time), each data-parallel rank gets its shard
(``moerl.trainer.shard``), the Trainer takes one optimizer step and a publisher
(``moerl.sync.publish``: full weights by bucketed broadcast, or LoRA adapters) sends
the new policy to the engines, bracketed by the rollout side's partial-rollout policy.
Every ``eval.every`` steps (and after the last) rank 0 starts a held-out evaluation of
the pushed policy on the rollout side, which runs beside generation and training and
reports into a later step's metrics line (the last step waits for it).

Resume: a checkpoint holds the model, optimizer, RNG, policy version, the data cursor and
the buffer's groups, so a resumed run continues at the next step with the same prompts
and data; metrics.jsonl is cut back to the checkpoint's step.
"""

from __future__ import annotations

import concurrent.futures
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from moerl import device
from moerl.config.schema import MoerlConfig
from moerl.config.sync import sync_backend, sync_transport, waits_for_load
from moerl.config.threads import overlapped
from moerl.sync.wire import WeightSyncError

log = logging.getLogger(__name__)

PUSH_ATTEMPTS = 3
"""A push that meets an engine dying is repeated after its restart, this often in all."""


@dataclass
class RunContext:
    """Where a run reads and writes, decided by the launcher before the ranks start."""

    run_dir: Path
    hf_dir: Path  # the initial HF checkpoint: the trainer loads it, the engines serve it
    engine_urls: list[str]
    engines: list[Any] = field(default_factory=list)  # rank 0: the EngineProcesses moerl owns
    reward_urls: list[str] = field(default_factory=list)  # the reward model's servers


class InFlight:
    """Rank 0's push of the last version, still completing while the trainer steps on:
    gathered and sent on a thread of its own (``staged``: sync.overlap) or sent, its
    landing left to the rollout loop (sync.wait_for_load=false). Other ranks hold one
    that never starts."""

    def __init__(self, staged: bool = True) -> None:
        self.staged = staged
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: concurrent.futures.Future[Any] | None = None
        self._metrics_of: Callable[[Any], dict[str, float]] = dict

    def start(self, send: Callable[[], dict[str, float]]) -> None:
        assert self._pending is None, "join() the push in flight first"
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, "moerl-push")
        self._pending, self._metrics_of = self._pool.submit(send), dict

    def adopt(
        self, landing: concurrent.futures.Future[Any], metrics_of: Callable[[Any], dict[str, float]]
    ) -> None:
        """Hold ``landing`` (a push completing elsewhere); its result's metrics are
        ``metrics_of(result)``."""
        assert self._pending is None, "join() the push in flight first"
        self._pending, self._metrics_of = landing, metrics_of

    def join(self) -> tuple[dict[str, float], BaseException | None]:
        """Wait for the push in flight: (its metrics, None) or ({}, its error); ({}, None)
        with none. ``sync/wait_s`` is how long the caller waited for it."""
        pending, self._pending = self._pending, None
        if pending is None:
            return {}, None
        t0 = time.perf_counter()
        try:
            metrics = self._metrics_of(pending.result())
        except Exception as err:
            return {}, err
        return {**metrics, "sync/wait_s": time.perf_counter() - t0}, None

    def close(self) -> None:
        """Wait for what is in flight (its error logged), stop the thread."""
        _, error = self.join()
        if error is not None:
            log.warning("the last weight push failed: %s", error)
        if self._pool is not None:
            self._pool.shutdown()


def _broadcast(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (as it is with one rank: nothing to send)."""
    if dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _due(every: int, step: int, last: int) -> bool:
    """Whether something done every ``every`` steps (0: never) happens after ``step``;
    the last step always does."""
    return step == last or bool(every and (step + 1) % every == 0)


def groups_per_step(cfg: MoerlConfig) -> int:
    """How many whole groups one step trains on."""
    batch, group = cfg.trainer.global_batch_size, cfg.rollout.group_size
    if batch % group:
        raise ValueError(
            f"trainer.global_batch_size={batch} is not a multiple of "
            f"rollout.group_size={group}; a step trains on whole groups"
        )
    return batch // group


def _weights_mb(hf_dir: Path) -> float:
    """The initial checkpoint's weight files in MB (what a full push moves, give or take
    the sync dtype)."""
    return sum(f.stat().st_size for f in Path(hf_dir).glob("*.safetensors")) / 2**20


def run_training(cfg: MoerlConfig, ctx: RunContext) -> dict[str, float]:
    """Train for ``cfg.trainer.train_iters`` steps; returns rank 0's last metrics."""
    from moerl.models.tokenizer import load_tokenizer
    from moerl.rollout.service import RolloutService
    from moerl.sync.publish import build_publisher
    from moerl.telemetry.runlog import open_run_log
    from moerl.trainer.shard import BatchScatter
    from moerl.trainer.trainer import Trainer

    leader, per_step = dist.get_rank() == 0, groups_per_step(cfg)
    trainer = Trainer(
        cfg.model, cfg.parallel, cfg.trainer, cfg.algo, cfg.correction, hf_dir=ctx.hf_dir,
        lora=cfg.lora,
    )  # fmt: skip
    # the tokenizer (0.5 s of transformers' imports) loads while the engines still start
    tokenizer = load_tokenizer(ctx.hf_dir) if leader else None
    for engine in ctx.engines:  # started by the launcher while the trainer was built
        engine.wait_healthy()
    start, last = trainer.version, cfg.trainer.train_iters - 1
    scatter = BatchScatter(cfg.trainer.minibatches)  # each data-parallel rank its shard
    rollout = None
    if leader:
        rollout = RolloutService(
            cfg, hf_dir=ctx.hf_dir, run_dir=ctx.run_dir, engine_urls=ctx.engine_urls,
            engines=ctx.engines, reward_urls=ctx.reward_urls, version=start,
            progress=trainer.progress, groups_per_step=per_step, tokenizer=tokenizer,
        )  # fmt: skip
    publisher = run_log = inflight = None
    try:
        publisher = build_publisher(
            cfg, trainer, client=rollout.client if rollout else None,
            run_coro=rollout.submit if rollout else None, run_dir=ctx.run_dir,
            hf_dir=ctx.hf_dir, backend=sync_backend(cfg.sync, cfg.engine.kind, device.has_cuda()),
            transport=sync_transport(
                cfg.sync, ctx.engine_urls, device.has_cuda(), _weights_mb(ctx.hf_dir),
                colocated=cfg.launcher.placement == "colocated",
            ),
        )  # fmt: skip
        # engines start from the initial checkpoint's weights; a resumed run, LoRA and the
        # matching numerics in bf16 (transformers keeps some weights, e.g. DeepSeek's
        # router, in fp32: loaded from the checkpoint they are not the trainer's bf16
        # values) push the trainer's own first
        matching_half = cfg.trainer.numerics == "batch_invariant" and cfg.trainer.dtype != "fp32"
        if start > 0 or trainer.lora is not None or matching_half:
            _publish(publisher, rollout, trainer.version, initial=True)
        overlap = cfg.sync.overlap and publisher.can_stage()
        waits = waits_for_load(cfg.sync, overlapped(cfg.staleness), publisher.lands_apart)
        if overlap or not waits:
            inflight = InFlight(staged=overlap)
        if rollout:
            rollout.start(on_restart=publisher.restore)
        run_log = open_run_log(cfg, ctx.run_dir, start, leader)
        sleeps = engines_sleep(cfg, device.has_cuda())  # the same on every rank
        sleep = rollout is not None and sleeps
        announces = cfg.sync.announce and inflight is None and not overlapped(cfg.staleness)
        train_s = 0.0  # the last step's, for the announcement's timeout check
        for step in range(start, cfg.trainer.train_iters):
            t0 = time.time()
            with run_log.span("wait", step=step):
                batch, trajs = _next_batch(rollout, publisher, scatter, trainer.version, inflight)
            wait_s = time.time() - t0
            push = _due(cfg.sync.every, step, last)
            landed = {}  # a sleeping engine frees the weights a push in flight writes
            if inflight is not None and sleeps:
                landed = _landed(inflight, rollout)
            # colocated: the engine's memory goes to the trainer until the push
            slept = bool(
                sleep and rollout and rollout.sleep_engines(_sleep_tags(push, trainer.lora is None))
            )
            if push and announces and not slept and rollout and rollout.quiet_for_push():
                publisher.announce(trainer.version + 1, train_s)  # rank 0's HTTP alone
            t_train = time.perf_counter()
            with run_log.span("train", step=step):
                metrics = {**landed, **trainer.step(trajs, **_probes(cfg, step, last))}
            train_s = time.perf_counter() - t_train
            if slept and rollout:
                rollout.wake_engines(["weights"])  # before a push: it writes into them
            # the rollout side's metrics, taken before the push, in the hand-off that
            # readies the rollout side for it where there is one: after the push, a
            # hand-off of their own delayed the next step's requests (the last step's
            # come after its push, with the final eval's)
            take = step != last
            if push:
                with run_log.span("sync", step=step, version=trainer.version):
                    metrics.update(
                        _publish(publisher, rollout, trainer.version, inflight=inflight,
                                 take_metrics=take)
                    )  # fmt: skip
            if rollout is not None and take:  # taken by the push's hand-off, if it had one
                metrics.update(rollout.metrics())
            if slept and rollout:
                rollout.wake_engines()
            evaluate = cfg.eval.enabled and _due(cfg.eval.every, step, last)
            saves = bool(cfg.trainer.checkpoint_dir) and _due(cfg.trainer.save_every, step, last)
            if inflight is not None and (evaluate or saves or step == last):
                metrics.update(_landed(inflight, rollout))  # they need the pushed version
            if rollout:
                if evaluate:
                    rollout.start_eval(step, trainer.version, final=step == last)
                if step == last:
                    metrics.update(rollout.metrics(wait_eval=True))
            run_log.log(
                step, batch or trajs, metrics, version=trainer.version - 1, wall_s=time.time() - t0,
                wait_s=wait_s,
            )  # fmt: skip
            if saves:
                with run_log.span("checkpoint", step=step):
                    trainer.save(step=step + 1, **(rollout.state() if rollout else {}))
            if step == start and cfg.launcher.gc_freeze:
                _freeze_gc(rollout)
        return run_log.last
    finally:
        if inflight is not None:
            inflight.close()
        _close(rollout, publisher, run_log)


def _freeze_gc(rollout: Any) -> None:
    """launcher.gc_freeze, after the run's first step (everything long-lived exists, and
    the engines served a batch): this rank's objects and, from rank 0, every engine's
    leave the garbage collector's scans (moerl/common/gc_freeze.py)."""
    from moerl.common.gc_freeze import freeze_gc

    count, seconds = freeze_gc()
    gc.enable()  # the launcher turns it off for the start
    log.info("froze the garbage collector's %d objects in %.2f s", count, seconds)
    if rollout is not None:
        rollout.freeze_engines_gc()


def engines_sleep(cfg: MoerlConfig, has_cuda: bool) -> bool:
    """Whether the colocated engine sleeps while the trainer steps (launcher.sleep_engine;
    None: on with CUDA)."""
    if cfg.launcher.placement != "colocated" or overlapped(cfg.staleness):
        return False
    wanted = cfg.launcher.sleep_engine
    return has_cuda if wanted is None else bool(wanted)


def _sleep_tags(push: bool, full_weights: bool) -> list[str]:
    """What the engine frees for a training step: its KV cache, and its weights when a
    full-weight push follows (it refills them; LoRA pushes only adapters)."""
    return ["kv_cache", "weights"] if push and full_weights else ["kv_cache"]


def _probes(cfg: MoerlConfig, step: int, last: int) -> dict[str, int]:
    """How many trajectories this step's mismatch decomposition and router flip-rate
    probes look at (0: not this step)."""
    tel = cfg.telemetry
    decompose = bool(tel.decompose_every and step % tel.decompose_every == 0)
    flips = bool(tel.flip_every and (step % tel.flip_every == 0 or step == last))
    return {
        "decompose_sample": tel.flip_sample if decompose else 0,
        "flip_sample": tel.flip_sample if flips else 0,
    }


def _next_batch(
    rollout: Any, publisher: Any, scatter: Any, version: int, inflight: InFlight | None = None
) -> tuple[Any, Any]:
    """Collective: the step's batch (rank 0; None elsewhere) and this rank's share. While
    rank 0 waits, an engine restarted meanwhile holds its requests until it has the
    current weights; every rank then pushes ``version`` again (``_publish``) and the
    wait goes on."""
    while True:
        batch = rollout.next_batch(version) if rollout else None
        trajs = scatter(batch)
        if trajs is not None:
            return batch, trajs
        if rollout:
            log.warning(
                "a restarted engine waits for the weights: pushing version %d before "
                "the step's batch is complete", version,
            )  # fmt: skip
        if inflight is not None:
            _landed(inflight, rollout)
        _publish(publisher, rollout, version)


def _landed(inflight: InFlight, rollout: Any) -> dict[str, float]:
    """Collective: the push in flight has landed; its metrics (rank 0)."""
    return _settle(*inflight.join(), rollout) or {}


def _settle(
    metrics: dict[str, float], error: BaseException | None, rollout: Any
) -> dict[str, float] | None:
    """Collective, on what a push sent while training left: its metrics; None when it
    failed and an engine was restarted meanwhile (the next push, a synchronous one,
    builds the group again and repeats it). Any other failure is raised on every rank."""
    if not _broadcast(error is not None):
        return metrics
    if _broadcast(rollout.engines_restarted() if rollout else False):
        log.warning("a weight push sent while training failed (%s); an engine was restarted", error)
        return None
    raise error or WeightSyncError("rank 0's weight push, sent while training, failed")


def _publish(
    publisher: Any,
    rollout: Any,
    version: int,
    initial: bool = False,
    inflight: InFlight | None = None,
    take_metrics: bool = False,
) -> dict[str, float]:
    """Collective: push policy ``version`` to the engines, inside the rollout side's
    update bracket; engines restarted since the last push join the group again first.
    Returns rank 0's sync metrics. ``initial``: before generation starts (no bracket).
    ``inflight``: the previous push must have landed (its metrics are returned); then
    this one is gathered now and sent on rank 0's push thread (sync.overlap, unless an
    engine restarted since) or sent now and left to land on the rollout loop
    (sync.wait_for_load=false). ``take_metrics``: the rollout side's bracket takes its
    metrics too (``RolloutService.before_update``), in the same hand-off."""
    landed = None
    if inflight is not None:
        landed = _settle(*inflight.join(), rollout)  # None: failed, repeated below
        if inflight.staged and landed is not None:
            if not _broadcast(rollout.restart_seen() if rollout else False):
                staged = publisher.stage()  # collective: the weights as they are now
                if rollout:
                    inflight.start(lambda: _send_staged(publisher, rollout, version, staged))
                return landed
    detach = inflight is not None and not inflight.staged and not initial
    pauses = publisher.pauses_generation and not initial
    atomic = publisher.atomic_push
    rejoin = _broadcast(
        rollout.before_update(pauses, atomic, take_metrics) if rollout and not initial else False
    )
    if rejoin:
        publisher.rejoin()
    # the next step's requests start as soon as the engines would serve them the new
    # policy: with ``early_ready``, once the last bucket is off the wire, while the
    # engines load it and answer (rank 0; a failed attempt's is waited for below)
    resumed: list[concurrent.futures.Future[None]] = []
    early = rollout is not None and not initial and not detach and publisher.early_ready

    def resume() -> None:
        assert rollout is not None
        resumed.append(rollout.start_after_update(version, paused=pauses, rejoined=rejoin))

    for attempt in range(1, PUSH_ATTEMPTS + 1):
        try:
            sent, error = (
                (
                    publisher.push_sent(version)
                    if detach
                    else publisher.push(version, on_ready=resume if early else None)
                ),
                None,
            )
        except WeightSyncError as err:  # rank 0's engine side; the others did their part
            sent, error = None, err
        for started in resumed:  # before a repeat (its own bracket's end runs again)
            started.result()
        if not _broadcast(error is not None):
            break
        # an engine that died during the push is restarted (and waited for) here; the
        # group is built again with it and the push repeated. Anything else is raised.
        restarted = _broadcast(rollout.engines_restarted() if rollout else False)
        if not restarted or attempt == PUSH_ATTEMPTS:
            raise error or WeightSyncError(f"rank 0 could not push version {version}")
        log.warning(
            "push of version %d failed (%s); an engine was restarted, pushing again",
            version, error,
        )  # fmt: skip
        publisher.rejoin()
        rejoin = True
    assert sent is not None
    if not rollout:
        return {}
    if detach:
        assert inflight is not None
        landing = rollout.after_landing(sent, version, paused=pauses, rejoined=rejoin)
        inflight.adopt(landing, _sync_metrics)
        return landed or {}
    if not resumed:
        rollout.after_update(version, paused=pauses, adapter=sent.adapter, rejoined=rejoin)
    return _sync_metrics(sent)


def _send_staged(publisher: Any, rollout: Any, version: int, staged: Any) -> dict[str, float]:
    """Rank 0's push thread: send ``staged`` (policy ``version``) inside the rollout side's
    update bracket. A failed send puts the rollout side back on the version the engines
    had, so generation goes on (with the engines that still serve) until the next push."""
    pauses = publisher.pauses_generation
    # restarted since the trainer looked: no group
    if rollout.before_update(pauses, publisher.atomic_push):
        raise WeightSyncError(f"an engine was restarted before the push of version {version}")
    try:
        pub = publisher.send_staged(staged, version)
    except BaseException:
        rollout.after_update(version - 1, paused=pauses)
        raise
    rollout.after_update(version, paused=pauses)
    return _sync_metrics(pub)


def _sync_metrics(pub: Any) -> dict[str, float]:
    """Rank 0's metrics of one push (a ``Publication``)."""
    return {
        "sync/seconds": float(pub.stats.get("seconds", 0.0)),
        "sync/bytes": float(pub.stats.get("bytes", 0.0)),
        # 1: its first request went before the trainer's step (sync.announce)
        "sync/announced": float(pub.stats.get("announced", 0.0)),
    }


def _close(rollout: Any, publisher: Any, run_log: Any) -> None:
    """Stop generation first (no request outlives the run), then the publisher and the
    run log. A failure to close is raised once everything was tried, unless the run is
    already failing (then it is logged and the run's own error goes on)."""
    import sys

    failing = sys.exc_info()[1] is not None  # called from a finally: the run's error
    errors = []
    # the publisher's last calls (destroying the weight group) run on the rollout's loop
    stop = rollout.stop_generation if rollout is not None else None
    for close in (stop, publisher and publisher.close, rollout and rollout.close,
                  run_log and run_log.close):  # fmt: skip
        try:
            if close is not None:
                close()
        except Exception as err:
            name = getattr(close, "__qualname__", "close")
            log.warning("closing: %s: %s", name, err)
            errors.append(err)
    if errors and not failing:
        raise errors[0]
