"""The run's record of itself, owned by one object: per-step metrics (metrics.jsonl and
its mirrors), the progress bar, the batch log and the trainer's timeline.

Rank 0 writes them (:class:`RunLog`); every other rank holds a :class:`NullRunLog` with
the same methods, so the loop calls them unconditionally.
"""

from __future__ import annotations

import logging
import re
import time
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import numpy as np

from moerl.config.schema import MoerlConfig

log = logging.getLogger(__name__)


def step_metrics(trajs: list[Any], version: int, wall_s: float, wait_s: float) -> dict[str, float]:
    """The per-step run metrics every metrics.jsonl line carries: staleness of the
    batch's tokens against ``version`` (the policy that trained on it), throughput and
    the trainer's idle fraction (``wait_s`` of ``wall_s`` spent waiting for the batch)."""
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
        # the policy's own tokens (an episode's observations are response tokens too)
        "trained_tokens": float(sum(t.num_trained for t in trajs)),
        "batch_versions": float(len(np.unique(versions))),
        "step_s": wall_s,
    }
    out.update(staleness_hist_metrics(staleness_histogram(versions, version)))
    out.update(zero_reward_metrics(trajs))
    return out


def _reason_key(reason: str) -> str:
    """A metric-name slug of a verifier's reward_reason: its head before ':', ';' or '(',
    without digits ("truncated (require_stop)" -> "truncated", "2/3 passed; test 1: ..."
    -> "passed")."""
    head = re.split(r"[:;(]", reason, maxsplit=1)[0].lower()
    words = re.findall(r"[a-z_]+", head)
    return "_".join(words)[:40] or "other"


def zero_reward_metrics(trajs: list[Any]) -> dict[str, float]:
    """Why rewards were 0: ``response_truncated_frac`` (cut at max_new_tokens: a verifier
    with require_stop scores those 0), ``reward_zero_frac``, and for the reasons the
    verifiers recorded (``traj.meta["reward_reason"]``) ``reward_zero/<reason>``, each a
    fraction of the batch (the 8 most common reasons; the rest under ``other``)."""
    n = max(len(trajs), 1)
    out = {
        "response_truncated_frac": sum(t.finish_reason == "length" for t in trajs) / n,
        "reward_zero_frac": sum(float(t.reward or 0.0) == 0.0 for t in trajs) / n,
    }
    counts: dict[str, int] = {}
    for t in trajs:
        reason = (getattr(t, "meta", None) or {}).get("reward_reason")
        if reason and float(t.reward or 0.0) == 0.0:
            key = _reason_key(str(reason))
            counts[key] = counts.get(key, 0) + 1
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])
    for key, count in ranked[:8]:
        out[f"reward_zero/{key}"] = count / n
    if len(ranked) > 8:
        out["reward_zero/other"] = sum(c for _, c in ranked[8:]) / n
    return out


ZERO_SPREAD = "advantage/adv/zero_std_group_frac"


class StallWatch:
    """telemetry.stall_warn_steps: counts the steps in a row whose every group had no
    spread of rewards (``ZERO_SPREAD`` 1: the advantages, so the policy gradient, are 0)
    and says why once the count reaches ``steps``."""

    def __init__(self, steps: int) -> None:
        self.steps, self.run = steps, 0

    def update(self, step: int, metrics: dict[str, float]) -> str | None:
        """The warning to give after ``step`` (its metrics line), or None."""
        spread = metrics.get(ZERO_SPREAD)
        if not self.steps or spread is None:
            return None
        if spread < 1.0:
            self.run = 0
            return None
        self.run += 1
        if self.run != self.steps:
            return None
        reward = float(metrics.get("reward_mean", float("nan")))
        if metrics.get("response_truncated_frac", 0.0) >= 1.0:
            why = ("every response was cut at rollout.max_new_tokens (a verifier that needs "
                   "the stop scores it 0): raise rollout.max_new_tokens, or lower trainer.lr "
                   "if the policy stopped emitting its stop token")  # fmt: skip
        elif metrics.get("reward_zero_frac", 0.0) >= 1.0:
            why = "every reward was 0 (reward_zero/* in metrics.jsonl gives the verifiers' reasons)"
        else:
            why = "every sample of each group scored the same: the task is too easy or too hard"
        return (
            f"steps {step - self.steps + 1}-{step}: no group had any spread of rewards "
            f"(reward_mean {reward:.3g}), so the advantages and the policy gradient were 0 "
            f"and the policy did not learn; {why} (telemetry.stall_warn_steps="
            f"{self.steps}; 0 turns this off)"
        )


class RunLog:
    """Rank 0's metrics writer, progress bar, batch log and timeline for one run."""

    def __init__(self, cfg: MoerlConfig, run_dir: Path, start_step: int) -> None:
        from moerl.telemetry.batches import BatchLog
        from moerl.telemetry.metrics import MetricsWriter
        from moerl.telemetry.progress import Progress
        from moerl.telemetry.timeline import Timeline

        tel = cfg.telemetry
        self.writer = MetricsWriter(
            run_dir, tensorboard=tel.tensorboard, wandb=tel.wandb,
            wandb_project=tel.wandb_project, resume_step=start_step,
        )  # fmt: skip
        self.bar = Progress(cfg.trainer.train_iters, min_interval_s=tel.progress_interval_s)
        self.batches = BatchLog(run_dir, resume_step=start_step)
        self.timeline = Timeline(run_dir, "trainer", enabled=tel.timeline)
        self.last: dict[str, float] = {}
        self.stall = StallWatch(tel.stall_warn_steps)
        self._t0 = time.time()

    def span(self, kind: str, **attrs: Any) -> AbstractContextManager[Any]:
        return self.timeline.span(kind, **attrs)

    def log(
        self,
        step: int,
        trajs: list[Any],
        metrics: dict[str, float],
        *,
        version: int,
        wall_s: float,
        wait_s: float,
    ) -> None:
        """One step's line: the trainer's and rollout side's ``metrics`` plus the run
        metrics of its batch (``step_metrics``); also the batch log and the bar."""
        metrics = {**metrics, **step_metrics(trajs, version, wall_s, wait_s)}
        if "mismatch/k3" in metrics:  # a metric that was not computed stays absent
            metrics["mismatch_k3"] = metrics["mismatch/k3"]
        metrics["time_s"] = time.time() - self._t0
        self.writer.log(step, metrics)
        self.batches.log(step, trajs)
        self.bar.update(step + 1, metrics)
        self.last = metrics
        stalled = self.stall.update(step, metrics)
        if stalled:
            log.warning(stalled)

    def close(self) -> None:
        self.writer.close()
        self.batches.close()
        self.bar.close()
        self.timeline.close()


class NullRunLog:
    """What ranks other than 0 log: nothing."""

    last: dict[str, float] = {}

    def span(self, kind: str, **attrs: Any) -> AbstractContextManager[Any]:
        return nullcontext()

    def log(self, step: int, trajs: list[Any], metrics: dict[str, float], **kw: Any) -> None:
        pass

    def close(self) -> None:
        pass


def open_run_log(cfg: MoerlConfig, run_dir: Path, start_step: int, leader: bool) -> Any:
    """A RunLog on the leader (rank 0), a NullRunLog elsewhere."""
    return RunLog(cfg, run_dir, start_step) if leader else NullRunLog()
