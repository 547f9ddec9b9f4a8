"""A live console progress line for the RL loop, and its plain twin for CI logs.

At a terminal a ``rich`` progress bar redraws in place with step/total, reward,
throughput, staleness, buffer occupancy and how idle the trainer is: the numbers that
tell at a glance whether generation or training is the bottleneck. Redirected to a
file (SLURM, CI) a redrawing bar would flood the log, so the same numbers are printed
as one plain line at most every ``min_interval_s`` seconds, plus the first and the
last step.

Metric keys read from ``update(step, metrics)`` (all optional, missing ones are left
out of the line): ``reward_mean``, ``tokens_per_s``, ``staleness_max``,
``buffer_size`` with ``buffer_capacity`` (or a ``buffer_occupancy`` fraction; the
``buffer/occupancy`` key of ``RolloutBuffer.metrics()`` is read as its alias),
``trainer_idle_frac``. The plain line ends with the mean seconds per step so far, the
elapsed time and the estimated time left (the rich bar shows the last two itself).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, TextIO


def _si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f}{unit}"
    return f"{x:.1f}"


def _num(metrics: Mapping[str, Any], *keys: str) -> float | None:
    """The first of ``keys`` present, as a float (None when absent or not a number)."""
    value = next((metrics[k] for k in keys if metrics.get(k) is not None), None)
    if value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def format_stats(metrics: Mapping[str, Any]) -> str:
    """The metric part of the line: ``reward 0.512 | 1.23k tok/s | stale<=2 | ...``."""
    parts = []
    if (r := _num(metrics, "reward_mean")) is not None:
        parts.append(f"reward {r:.3f}")
    if (t := _num(metrics, "tokens_per_s")) is not None:
        parts.append(f"{_si(t)} tok/s")
    if (s := _num(metrics, "staleness_max")) is not None:
        parts.append(f"stale<={s:g}")
    size, cap = _num(metrics, "buffer_size"), _num(metrics, "buffer_capacity")
    if size is not None and cap:
        parts.append(f"buffer {size:g}/{cap:g}")
    elif (occ := _num(metrics, "buffer_occupancy", "buffer/occupancy")) is not None:
        parts.append(f"buffer {occ:.0%}")
    if (idle := _num(metrics, "trainer_idle_frac")) is not None:
        parts.append(f"trainer idle {idle:.0%}")
    return " | ".join(parts)


def _hms(seconds: float) -> str:
    minutes, sec = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{sec:02d}" if hours else f"{minutes}:{sec:02d}"


def format_line(
    step: int, total: int, metrics: Mapping[str, Any], elapsed_s: float | None = None
) -> str:
    """The whole plain line, e.g. ``step 3/10 | reward 0.512 | ... | 2.10 s/step |
    0:06 elapsed | ETA 0:15`` (the timing with ``elapsed_s``, after a step)."""
    parts = [f"step {step}/{total}"]
    if stats := format_stats(metrics):
        parts.append(stats)
    if elapsed_s is not None and step > 0:
        per_step = elapsed_s / step
        parts.append(f"{per_step:.2f} s/step | {_hms(elapsed_s)} elapsed | "
                     f"ETA {_hms(per_step * max(0, total - step))}")  # fmt: skip
    return " | ".join(parts)


class Progress:
    """Live progress of an RL run: a rich bar at a TTY, throttled plain lines elsewhere.

    ``stream`` defaults to ``sys.stdout`` looked up at construction (so pytest's capsys
    and redirections apply); ``tty`` overrides the ``isatty()`` check.
    """

    def __init__(
        self,
        total_steps: int,
        *,
        min_interval_s: float = 30.0,
        stream: TextIO | None = None,
        tty: bool | None = None,
        description: str = "train",
        clock: Callable[[], float] = time.monotonic,
    ):
        if total_steps < 0:
            raise ValueError(f"total_steps must be >= 0, got {total_steps}")
        self.total_steps = int(total_steps)
        self.min_interval_s = float(min_interval_s)
        self._stream = stream if stream is not None else sys.stdout
        if tty is None:
            isatty = getattr(self._stream, "isatty", None)
            tty = bool(isatty and isatty())
        self.tty = tty
        self._clock = clock
        self._start = clock()
        self._last_print: float | None = None
        self._pending: str | None = None  # newest line not yet printed (plain mode)
        self._closed = False
        self._rich: Any = None
        self._task: Any = None
        if self.tty:
            self._start_rich(description)

    def _start_rich(self, description: str) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
        from rich.progress import Progress as RichProgress

        self._rich = RichProgress(
            TextColumn("[bold]{task.description}"),
            BarColumn(bar_width=24),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("<"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[stats]}"),
            console=Console(file=self._stream, force_terminal=True),
            refresh_per_second=4,
        )
        self._task = self._rich.add_task(description, total=self.total_steps, stats="")
        self._rich.start()

    def update(self, step: int, metrics: Mapping[str, Any] | None = None) -> None:
        """Show ``step`` (steps done so far) and the step's metrics."""
        if self._closed:
            raise ValueError("Progress.update after close()")
        metrics = metrics or {}
        if self._rich is not None:
            self._rich.update(self._task, completed=step, stats=format_stats(metrics))
            return
        now = self._clock()
        line = format_line(step, self.total_steps, metrics, now - self._start)
        due = self._last_print is None or now - self._last_print >= self.min_interval_s
        if due or step >= self.total_steps:
            self._print(line, now)
        else:
            self._pending = line

    def _print(self, line: str, now: float) -> None:
        print(line, file=self._stream, flush=True)
        self._last_print = now
        self._pending = None

    def close(self) -> None:
        """Stop the live bar, or print the newest line the throttle held back."""
        if self._closed:
            return
        self._closed = True
        if self._rich is not None:
            self._rich.stop()
        elif self._pending is not None:
            self._print(self._pending, self._clock())

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
