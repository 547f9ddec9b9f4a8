"""Per-step run metrics: ``run_dir/metrics.jsonl``, optionally mirrored to TensorBoard/W&B.

The jsonl file is the source of truth: ``tools/plot_run.py`` and the benchmarks read
it, it needs no extra package, and it survives a crash (see ``moerl.telemetry.jsonl``:
one ``os.write`` per line). TensorBoard and W&B are mirrors, imported only when
enabled so a CPU laptop never needs them.

One object per step, with strictly increasing steps. A resumed run restarts from its
last checkpoint, so steps logged after that checkpoint would appear twice;
``truncate_after(resume_step)`` (or ``MetricsWriter(..., resume_step=N)``) drops every
entry with ``step >= resume_step`` before the run logs them again.

Keys the main loop provides every step (``REQUIRED_KEYS``): ``step``, ``reward_mean``,
``staleness_max``, ``tokens_per_s``, ``trainer_idle_frac``, ``mismatch_k3``. Only
``step`` is enforced here; everything else is a free-form number. Conventions the
plots understand (``moerl.telemetry.plots``):

- ``time_s``: seconds since the run started (reward against wall-clock);
- ``staleness_hist/<k>``: tokens consumed this step with version gap ``k``
  (``staleness_hist_metrics`` builds them from ``mismatch.staleness_histogram``);
- ``mismatch/routing``, ``mismatch/sampling_mask``, ``mismatch/staleness``,
  ``mismatch/numerics``: the mismatch decomposition (``decomposition_metrics``).

The writer adds ``wall_time`` (unix seconds) to each line unless given, so metrics
line up with the timeline spans, which use the same clock.
"""

from __future__ import annotations

import numbers
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from moerl.telemetry.jsonl import AppendFile, encode_line, iter_records, repair_tail
from moerl.telemetry.mismatch import Decomposition

REQUIRED_KEYS = (
    "step",
    "reward_mean",
    "staleness_max",
    "tokens_per_s",
    "trainer_idle_frac",
    "mismatch_k3",
)
METRICS_FILE = "metrics.jsonl"
STALENESS_HIST_PREFIX = "staleness_hist/"
MISMATCH_KEYS = (
    "mismatch/routing",
    "mismatch/sampling_mask",
    "mismatch/staleness",
    "mismatch/numerics",
)


def staleness_hist_metrics(hist: Mapping[int, int]) -> dict[str, float]:
    """``{gap: tokens}`` → ``{"staleness_hist/<gap>": tokens}`` for ``MetricsWriter.log``."""
    return {f"{STALENESS_HIST_PREFIX}{int(k)}": float(v) for k, v in hist.items()}


def decomposition_metrics(dec: Decomposition) -> dict[str, float]:
    """The mismatch decomposition under the ``mismatch/<component>`` keys plots read."""
    return {
        "mismatch/total": dec.total,
        "mismatch/routing": dec.routing,
        "mismatch/sampling_mask": dec.sampling_mask,
        "mismatch/staleness": dec.staleness,
        "mismatch/numerics": dec.numerics,
    }


def read_metrics(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All complete entries of ``run_dir/metrics.jsonl``, in file (= step) order."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: is {run_dir} a moerl run directory?")
    return list(iter_records(path))


def _number(key: str, value: Any) -> float | int | None:
    if value is None:
        return None
    if hasattr(value, "item") and callable(value.item):  # numpy / 0-d torch scalars
        try:
            value = value.item()
        except (ValueError, RuntimeError) as e:  # arrays/tensors with several elements
            raise TypeError(f"metric {key!r} must be a scalar, got {value!r}") from e
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(f"metric {key!r} must be a number, got {type(value).__name__}: {value!r}")


class MetricsWriter:
    """Appends one JSON line per step to ``run_dir/metrics.jsonl``; optional mirrors."""

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        tensorboard: bool = False,
        wandb: bool = False,
        wandb_project: str | None = None,
        resume_step: int | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        repair_tail(self.path)  # a crash may have cut the last line short
        self._last_step: int | None = None
        if resume_step is not None:
            self.truncate_after(resume_step)
        else:
            for record in iter_records(self.path) if self.path.exists() else ():
                if isinstance(record.get("step"), int):
                    self._last_step = record["step"]
        self._file = AppendFile(self.path)
        self._tb = self._open_tensorboard(resume_step) if tensorboard else None
        self._wandb = self._open_wandb(wandb_project) if wandb else None

    def _open_tensorboard(self, resume_step: int | None) -> Any:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ImportError(
                "TensorBoard logging is enabled but the tensorboard package is missing: "
                "pip install tensorboard (or turn TensorBoard logging off)"
            ) from e
        # purge_step hides events a crashed run wrote past the checkpoint, like
        # truncate_after does for the jsonl.
        return SummaryWriter(log_dir=str(self.run_dir / "tensorboard"), purge_step=resume_step)

    def _open_wandb(self, project: str | None) -> Any:
        try:
            import wandb
        except ImportError as e:
            raise ImportError(
                "W&B logging is enabled but the wandb package is missing: "
                "pip install wandb (or turn W&B logging off)"
            ) from e
        # Keep the run id in the run dir so a resumed run continues the same W&B run.
        id_file = self.run_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.exists() else wandb.util.generate_id()
        id_file.write_text(run_id + "\n")
        return wandb.init(
            project=project,
            dir=str(self.run_dir),
            id=run_id,
            resume="allow",
            name=self.run_dir.name,
        )

    def truncate_after(self, step: int) -> int:
        """Drop every entry with ``step >= step`` (the step a resumed run restarts at).

        Rewrites the file through a temporary and ``os.replace`` so a crash here leaves
        either the old or the new file. Returns the number of entries dropped.
        """
        if not self.path.exists():
            self._last_step = None
            return 0
        keep: list[bytes] = []
        dropped = 0
        last: int | None = None
        for record in iter_records(self.path):
            s = record.get("step")
            if isinstance(s, int) and s >= step:
                dropped += 1
                continue
            keep.append(encode_line(record))
            if isinstance(s, int):
                last = s
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_bytes(b"".join(keep))
        reopen = getattr(self, "_file", None) is not None and not self._file.closed
        if reopen:
            self._file.close()
        os.replace(tmp, self.path)
        if reopen:
            self._file = AppendFile(self.path)
        self._last_step = last
        return dropped

    def log(self, step: int | None, metrics: Mapping[str, Any] | None = None) -> None:
        """Write one step's metrics as one line (and to the enabled mirrors).

        ``step`` may also come in ``metrics["step"]``; steps must strictly increase, so
        a step's metrics belong in one call.
        """
        metrics = dict(metrics or {})
        if step is None:
            step = metrics.get("step")
        if step is None:
            raise ValueError(
                "MetricsWriter.log needs a step: call log(step, metrics) or put 'step' in "
                f"metrics (got keys {sorted(metrics)})"
            )
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        step = int(step)
        if "step" in metrics and metrics["step"] != step:
            raise ValueError(f"log(step={step}) disagrees with metrics['step']={metrics['step']}")
        if self._last_step is not None and step <= self._last_step:
            raise ValueError(
                f"step {step} logged after step {self._last_step}: steps must strictly increase "
                "(merge a step's metrics into one log call; on resume pass resume_step)"
            )
        record: dict[str, Any] = {"step": step}
        for key, value in metrics.items():
            if key != "step":
                record[str(key)] = _number(key, value)
        record.setdefault("wall_time", time.time())
        self._file.write(record)
        self._last_step = step
        scalars = {
            k: v for k, v in record.items() if k not in ("step", "wall_time") and v is not None
        }
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, global_step=step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
