"""The asynchronous RL loop, run by every trainer rank.

Rank 0 owns the rollout side on an asyncio thread: the engine client, the bounded
RolloutBuffer and the Orchestrator, which keeps generating while the trainer learns.
Each step, rank 0 takes a batch of groups from the buffer (the only place the trainer
can wait on generation: that wait is the trainer's idle time), every rank gets the same
trajectories, the Trainer takes one optimizer step and the new weights go to the engines
by bucketed broadcast (the orchestrator's partial-rollout policy brackets the push).

Resume: a checkpoint holds the model, optimizer, RNG, policy version, the data cursor and
the buffer's groups, so a resumed run continues at the next step with the same prompts
and data; metrics.jsonl is cut back to the checkpoint's step.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist

from moerl import device
from moerl.config.schema import MoerlConfig


@dataclass
class RunContext:
    """Where a run reads and writes, decided by the launcher before the ranks start."""

    run_dir: Path
    hf_dir: Path  # the initial HF checkpoint: the trainer loads it, the engines serve it
    engine_urls: list[str]
    engines: list[Any] = field(default_factory=list)  # rank 0: the EngineProcesses moerl owns


def _broadcast(obj: Any) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _step_metrics(trajs: list[Any], version: int, wall_s: float, wait_s: float) -> dict[str, float]:
    """The per-step run metrics every metrics.jsonl line carries."""
    from moerl.telemetry.metrics import staleness_hist_metrics
    from moerl.telemetry.mismatch import staleness_histogram

    versions = np.concatenate([np.asarray(t.versions) for t in trajs])
    tokens = int(sum(t.response_len for t in trajs))
    gap = version - versions
    out = {
        "staleness_max": float(gap.max()) if gap.size else 0.0,
        "staleness_mean": float(gap.mean()) if gap.size else 0.0,
        "tokens_per_s": tokens / max(wall_s, 1e-9),
        "trainer_idle_frac": wait_s / max(wall_s, 1e-9),
        "response_len_mean": tokens / max(len(trajs), 1),
        "batch_versions": float(len(np.unique(versions))),
        "step_s": wall_s,
    }
    out.update(staleness_hist_metrics(staleness_histogram(versions, version)))
    return out


def run_training(cfg: MoerlConfig, ctx: RunContext) -> dict[str, float]:
    """Train for ``cfg.trainer.train_iters`` steps; returns rank 0's last metrics."""
    from moerl.models.tokenizer import load_tokenizer
    from moerl.rollout.aio import EventLoopThread
    from moerl.rollout.buffer import RolloutBuffer
    from moerl.rollout.client import EngineClient
    from moerl.rollout.faults import make_client as make_rollout_client
    from moerl.rollout.orchestrator import Orchestrator
    from moerl.rollout.supervisor import EngineSupervisor
    from moerl.sync.adapters import AdapterSync
    from moerl.sync.weights import WeightSync
    from moerl.tasks import build_task
    from moerl.telemetry.batches import BatchLog
    from moerl.telemetry.metrics import MetricsWriter
    from moerl.telemetry.progress import Progress
    from moerl.telemetry.timeline import Timeline
    from moerl.trainer.trainer import Trainer

    leader = dist.get_rank() == 0
    trainer = Trainer(
        cfg.model, cfg.parallel, cfg.trainer, cfg.algo, cfg.correction, hf_dir=ctx.hf_dir,
        lora=cfg.lora,
    )  # fmt: skip
    use_lora = trainer.lora is not None
    start = trainer.version
    progress_state = trainer.progress
    group_size = cfg.rollout.group_size
    if cfg.trainer.global_batch_size % group_size:
        raise ValueError(
            f"trainer.global_batch_size={cfg.trainer.global_batch_size} is not a multiple of "
            f"rollout.group_size={group_size}; a step trains on whole groups"
        )
    groups_per_step = cfg.trainer.global_batch_size // group_size

    aio = EventLoopThread("moerl-rollout") if leader else None
    client = buffer = orch = orch_future = writer = bar = timeline = batches = None
    supervisor = supervisor_future = None
    if leader:
        assert aio is not None

        async def make_client() -> EngineClient:
            return make_rollout_client(ctx.engine_urls, cfg.rollout)

        client = aio.run(make_client())
        aio.run(client.wait_until_healthy(cfg.engine.startup_timeout_s))
    backend = cfg.sync.backend or ("nccl" if device.has_cuda() else "gloo")

    def connect() -> Any:
        if use_lora:  # only adapters move; each version is a new engine adapter
            return AdapterSync(
                trainer.adapters, trainer.peft_config(), client=client,
                run_coro=aio.submit if aio else None,
                on_loaded=(lambda n, v: aio.run(_call(orch.set_adapter, n, v))) if aio else None,
                transport=cfg.sync.adapter_transport,
                directory=cfg.sync.adapter_dir or ctx.run_dir / "adapters",
            )  # fmt: skip
        ws = WeightSync(
            trainer.chunks, cfg.model, client=client, bucket_mb=cfg.sync.bucket_mb,
            dtype=cfg.sync.dtype, backend=backend, master_address=cfg.sync.master_address,
            master_port=cfg.sync.master_port, run_coro=aio.submit if aio else None,
            flush_cache=cfg.rollout.partial_rollout != "in_place",
        )  # fmt: skip
        ws.connect()
        return ws

    if leader:
        assert aio is not None and client is not None
        if cfg.telemetry.timeline:
            timeline = Timeline(ctx.run_dir, "trainer")
        tokenizer = load_tokenizer(ctx.hf_dir)
        task = build_task(cfg.task, tokenizer)

        async def make_rollout() -> tuple[Any, Any]:
            buf = RolloutBuffer(
                cfg.buffer, cfg.staleness, groups_per_step=groups_per_step, version=start
            )
            if progress_state.get("buffer"):
                buf.load_state_dict(progress_state["buffer"])
            o = Orchestrator(
                client, task, buf, cfg.rollout, num_layers=cfg.model.num_layers,
                topk=cfg.model.moe_router_topk, start_cursor=int(progress_state.get("cursor", 0)),
                timeline=Timeline(ctx.run_dir, "rollout") if cfg.telemetry.timeline else None,
            )  # fmt: skip
            if progress_state.get("orchestrator"):
                o.load_state_dict(progress_state["orchestrator"])
            return buf, o

        buffer, orch = aio.run(make_rollout())

    sync = connect()
    if start > 0 or use_lora:  # engines start from the initial weights, without adapters
        sync.push(trainer.version)

    if leader:
        assert aio is not None and orch is not None
        orch_future = aio.submit(orch.run())

        async def make_supervisor() -> EngineSupervisor:
            return EngineSupervisor(
                client, ctx.engine_urls, ctx.engines, interval_s=cfg.engine.health_interval_s,
                max_failures=cfg.engine.max_health_failures, max_restarts=cfg.engine.max_restarts,
                on_restart=sync.restore if use_lora else None,
            )  # fmt: skip

        supervisor = aio.run(make_supervisor())
        supervisor_future = aio.submit(supervisor.run())
        writer = MetricsWriter(
            ctx.run_dir, tensorboard=cfg.telemetry.tensorboard, wandb=cfg.telemetry.wandb,
            wandb_project=cfg.telemetry.wandb_project, resume_step=start,
        )  # fmt: skip
        bar = Progress(cfg.trainer.train_iters, min_interval_s=cfg.telemetry.progress_interval_s)
        batches = BatchLog(ctx.run_dir, resume_step=start)

    def span(kind: str, **attrs: Any) -> Any:
        return timeline.span(kind, **attrs) if timeline is not None else nullcontext()

    last: dict[str, float] = {}
    t_run = time.time()
    try:
        for step in range(start, cfg.trainer.train_iters):
            t0 = time.time()
            trajs = None
            if leader:
                assert aio is not None and buffer is not None and orch_future is not None
                with span("wait", step=step):
                    batch_future = aio.submit(buffer.get_batch(groups_per_step, trainer.version))
                    while not batch_future.done():
                        for role, fut in (
                            ("orchestrator", orch_future),
                            ("supervisor", supervisor_future),
                        ):
                            if fut is not None and fut.done():  # surface its error
                                fut.result()
                                raise RuntimeError(f"the {role} stopped before the run ended")
                        time.sleep(0.01)
                    trajs = [t for group in batch_future.result() for t in group]
            wait_s = time.time() - t0
            trajs = _broadcast(trajs)
            with span("train", step=step):
                every, flip_every = cfg.telemetry.decompose_every, cfg.telemetry.flip_every
                last_step = step == cfg.trainer.train_iters - 1
                sample = cfg.telemetry.flip_sample
                metrics = trainer.step(
                    trajs,
                    decompose_sample=sample if every and step % every == 0 else 0,
                    flip_sample=sample
                    if flip_every and (step % flip_every == 0 or last_step)
                    else 0,
                )
            if (step + 1) % cfg.sync.every == 0 or step == cfg.trainer.train_iters - 1:
                with span("sync", step=step, version=trainer.version):
                    # engines restarted since the last push join a new weight group
                    rejoin = _broadcast(
                        aio.run(supervisor.before_push()) if aio and supervisor else False
                    )
                    if rejoin and not use_lora:
                        if leader:
                            _close_quietly(sync)
                        sync = connect()
                    if leader and not use_lora:  # loading an adapter disturbs no request
                        assert aio is not None and orch is not None
                        aio.run(orch.before_update())
                    stats = sync.push(trainer.version)
                    if leader:
                        assert aio is not None and orch is not None
                        if not use_lora:
                            aio.run(orch.after_update(trainer.version))
                        if rejoin:
                            assert supervisor is not None
                            aio.run(supervisor.reconnected())
                        aio.run(_call(buffer.set_version, trainer.version))
                        metrics["sync/seconds"] = float(stats.get("seconds", 0.0))
                        metrics["sync/bytes"] = float(stats.get("bytes", 0.0))
            wall = time.time() - t0
            if leader:
                assert aio is not None and buffer is not None and orch is not None
                metrics.update(_step_metrics(trajs, trainer.version - 1, wall, wait_s))
                if "mismatch/k3" in metrics:  # a metric that was not computed stays absent
                    metrics["mismatch_k3"] = metrics["mismatch/k3"]
                metrics["time_s"] = time.time() - t_run
                metrics.update(aio.run(_call(buffer.metrics)))
                metrics.update(aio.run(_call(orch.metrics)))
                if supervisor is not None:
                    metrics.update(supervisor.metrics())
                assert writer is not None and bar is not None and batches is not None
                writer.log(step, metrics)
                batches.log(step, trajs)
                bar.update(step + 1, metrics)
                last = metrics
            every = cfg.trainer.save_every
            if cfg.trainer.checkpoint_dir and (
                (every and (step + 1) % every == 0) or step == cfg.trainer.train_iters - 1
            ):
                state = None
                if leader:
                    assert aio is not None and buffer is not None and orch is not None
                    state = aio.run(_call(lambda: _rollout_state(buffer, orch)))
                state = _broadcast(state)
                with span("checkpoint", step=step):
                    trainer.save(step=step + 1, **state)
    finally:
        if leader:
            assert aio is not None
            if supervisor is not None:
                aio.run(_call(supervisor.stop))
            if orch is not None:
                aio.run(orch.stop(), timeout=60)
            if buffer is not None:
                aio.run(_call(buffer.close))
            if writer is not None:
                writer.close()
            if batches is not None:
                batches.close()
            if bar is not None:
                bar.close()
        if leader:
            _close_quietly(sync)
        if aio is not None:
            if client is not None:
                aio.run(client.aclose())
            aio.stop()
    return last


def _close_quietly(sync: Any) -> None:
    """Close a weight group that a restarted engine is no longer part of."""
    import logging

    try:
        sync.close()
    except Exception as err:  # the restarted engine never had the group
        logging.getLogger(__name__).info("closing the old weight group: %s", err)


async def _call(fn: Any, *args: Any) -> Any:
    """Run a plain function on the rollout loop's thread (the buffer is not thread-safe)."""
    return fn(*args)


def _rollout_state(buffer: Any, orch: Any) -> dict[str, Any]:
    return {
        "cursor": int(orch.cursor),
        "buffer": buffer.state_dict(),
        "orchestrator": orch.state_dict(),
    }
