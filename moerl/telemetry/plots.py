"""PNG plots of a run directory: reward, staleness, mismatch decomposition, timeline.

Used by ``tools/plot_run.py`` and importable by benchmarks. Figures are built with
``matplotlib.figure.Figure`` and saved through the Agg renderer, never through
``pyplot``: no display is needed (SLURM nodes, CI) and importing this module does not
switch the process-wide matplotlib backend under a user's notebook.

Inputs (see ``moerl.telemetry.metrics`` and ``moerl.telemetry.timeline``):

- ``metrics.jsonl`` — one object per step. ``reward.png`` plots ``reward_mean`` against
  ``step`` and against wall-clock: ``time_s`` (seconds since the run started) when
  present, else ``wall_time`` relative to the first step.
- Staleness histogram convention: a step may carry keys ``staleness_hist/<k>`` whose
  value is the number of tokens consumed by that step's update with version gap ``k``
  (trainer version − sampling version, an int ``>= 0``; see
  ``mismatch.staleness_histogram`` and ``metrics.staleness_hist_metrics``).
  ``staleness.png`` sums them over all steps into the run's token-level distribution
  of staleness. Without such keys it falls back to a histogram of the per-step
  ``staleness_max``.
- ``mismatch.png`` — mean over steps of ``mismatch/routing``,
  ``mismatch/sampling_mask``, ``mismatch/staleness``, ``mismatch/numerics``.
- ``timeline.<process>.jsonl`` — ``timeline.png`` has one row per process; spans that
  overlap within a process (concurrent generation requests) get stacked lanes.

A plot whose inputs are absent is skipped with a message rather than drawn empty.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from moerl.telemetry.metrics import MISMATCH_KEYS, STALENESS_HIST_PREFIX, read_metrics
from moerl.telemetry.timeline import load_timeline

KIND_COLORS = {
    "generate": "tab:blue",
    "train": "tab:orange",
    "sync": "tab:green",
    "wait": "tab:gray",
}
_EXTRA_COLORS = ["tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan"]
MAX_LANES = 16  # beyond this many concurrent spans per process, lanes are reused


def _value(entry: dict[str, Any], key: str) -> float | None:
    v = entry.get(key)
    if v is None or isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else None


def series(metrics: Sequence[dict[str, Any]], key: str, x: str = "step") -> tuple[list, list]:
    """(x, y) of the entries where both are numbers."""
    xs, ys = [], []
    for entry in metrics:
        xv, yv = _value(entry, x), _value(entry, key)
        if xv is not None and yv is not None:
            xs.append(xv)
            ys.append(yv)
    return xs, ys


def _save(fig: Figure, out_path: str | os.PathLike[str]) -> Path:
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=100, format="png")
    return out_path


def plot_reward(metrics: Sequence[dict[str, Any]], out_path: str | os.PathLike[str]) -> Path | None:
    """``reward_mean`` vs step, and vs wall-clock when the run recorded time."""
    steps, rewards = series(metrics, "reward_mean")
    if not steps:
        return None
    times, t_rewards = series(metrics, "reward_mean", x="time_s")
    time_label = "time since start (s)"
    if not times:
        times, t_rewards = series(metrics, "reward_mean", x="wall_time")
        times = [t - times[0] for t in times] if times else []
        time_label = "wall-clock since first step (s)"
    fig = Figure(figsize=(10 if times else 6, 4), layout="constrained")
    axes = fig.subplots(1, 2 if times else 1, squeeze=False)[0]
    axes[0].plot(steps, rewards, marker="." if len(steps) < 50 else None)
    axes[0].set_xlabel("step")
    axes[0].set_ylabel("reward_mean")
    if times:
        axes[1].plot(times, t_rewards, marker="." if len(times) < 50 else None)
        axes[1].set_xlabel(time_label)
        axes[1].set_ylabel("reward_mean")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle("reward")
    return _save(fig, out_path)


def staleness_counts(metrics: Sequence[dict[str, Any]]) -> dict[int, float]:
    """Tokens per version gap summed over steps, from ``staleness_hist/<k>`` keys."""
    counts: dict[int, float] = defaultdict(float)
    for entry in metrics:
        for key in entry:
            if key.startswith(STALENESS_HIST_PREFIX):
                try:
                    gap = int(key[len(STALENESS_HIST_PREFIX) :])
                except ValueError:
                    continue
                if (v := _value(entry, key)) is not None:
                    counts[gap] += v
    return dict(sorted(counts.items()))


def plot_staleness(
    metrics: Sequence[dict[str, Any]], out_path: str | os.PathLike[str]
) -> Path | None:
    """Token-level staleness distribution, or the per-step maximum's histogram."""
    counts = staleness_counts(metrics)
    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.subplots()
    if counts and sum(counts.values()) > 0:
        total = sum(counts.values())
        ax.bar(list(counts), [c / total for c in counts.values()], width=0.8)
        ax.set_xlabel("version gap (trainer version − sampling version)")
        ax.set_ylabel("fraction of tokens")
        ax.set_title(f"token staleness ({total:.0f} tokens)")
    else:
        _, maxima = series(metrics, "staleness_max")
        if not maxima:
            return None
        lo, hi = math.floor(min(maxima)), math.ceil(max(maxima))
        ax.hist(maxima, bins=[b - 0.5 for b in range(lo, hi + 2)], rwidth=0.8)
        ax.set_xlabel("staleness_max (versions)")
        ax.set_ylabel("steps")
        ax.set_title("per-step maximum staleness")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # gaps are whole versions
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, out_path)


def plot_mismatch(
    metrics: Sequence[dict[str, Any]], out_path: str | os.PathLike[str]
) -> Path | None:
    """Mean over steps of each mismatch component (k3 KL attributed to its cause)."""
    names, means = [], []
    for key in MISMATCH_KEYS:
        _, ys = series(metrics, key)
        if ys:
            names.append(key.split("/", 1)[1])
            means.append(sum(ys) / len(ys))
    if not names:
        return None
    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.subplots()
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:gray"][: len(names)]
    ax.bar(names, means, color=colors)
    ax.axhline(0.0, color="black", linewidth=0.8)
    ax.set_ylabel("k3 KL, mean over steps")
    ax.set_title("train/inference mismatch by component")
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, out_path)


def assign_lanes(spans: Sequence[dict[str, Any]]) -> list[int]:
    """Greedy interval partitioning: the lowest lane free at each span's start."""
    order = sorted(range(len(spans)), key=lambda i: spans[i]["start"])
    lane_end: list[float] = []
    lanes = [0] * len(spans)
    for i in order:
        s = spans[i]
        free = next((j for j, end in enumerate(lane_end) if end <= s["start"]), None)
        if free is None:
            free = len(lane_end)
            lane_end.append(s["end"])
        else:
            lane_end[free] = s["end"]
        lanes[i] = free
    return lanes


def plot_timeline(spans: Sequence[dict[str, Any]], out_path: str | os.PathLike[str]) -> Path | None:
    """One row per process, a colored bar per span; overlapping spans get lanes."""
    if not spans:
        return None
    t0 = min(s["start"] for s in spans)
    by_process: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for s in spans:
        by_process[str(s["process"])].append(s)
    processes = sorted(by_process)
    kinds = sorted({str(s["kind"]) for s in spans}, key=lambda k: (k not in KIND_COLORS, k))
    extra = iter(_EXTRA_COLORS * (len(kinds) // len(_EXTRA_COLORS) + 1))
    colors = {k: KIND_COLORS.get(k) or next(extra) for k in kinds}

    fig = Figure(figsize=(12, 1.0 + 0.7 * len(processes)), layout="constrained")
    ax = fig.subplots()
    for row, process in enumerate(processes):
        rows = by_process[process]
        lanes = assign_lanes(rows)
        n_lanes = min(max(lanes) + 1, MAX_LANES)
        height = 0.8 / n_lanes
        bars: dict[tuple[str, int], list[tuple[float, float]]] = defaultdict(list)
        for s, lane in zip(rows, lanes):
            bars[(str(s["kind"]), lane % MAX_LANES)].append(
                (s["start"] - t0, s["end"] - s["start"])
            )
        for (kind, lane), xranges in bars.items():
            y = row - 0.4 + lane * height
            ax.broken_barh(xranges, (y, height * 0.9), facecolors=colors[kind], alpha=0.85)
    ax.set_yticks(range(len(processes)), processes)
    ax.set_ylim(-0.6, len(processes) - 0.4)
    ax.invert_yaxis()
    ax.set_xlabel("time since first span (s)")
    ax.set_title("generation vs training timeline")
    ax.grid(alpha=0.3, axis="x")
    handles = [Patch(color=colors[k], label=k) for k in kinds]
    ax.legend(handles=handles, loc="upper right", fontsize="small", ncols=min(len(kinds), 6))
    return _save(fig, out_path)


def plot_run(
    run_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str] | None = None,
    *,
    log: Callable[[str], None] = print,
) -> list[Path]:
    """Write every plot the run's data allows into ``out_dir`` (default: run_dir).

    Returns the paths written; skipped plots are reported through ``log``. Raises
    ``FileNotFoundError`` when ``run_dir`` has no ``metrics.jsonl``.
    """
    run_dir = Path(run_dir)
    out = Path(out_dir) if out_dir is not None else run_dir
    metrics = read_metrics(run_dir)
    spans = load_timeline(run_dir)
    jobs: list[tuple[str, Callable[[], Path | None], str]] = [
        ("reward.png", lambda: plot_reward(metrics, out / "reward.png"), "no reward_mean values"),
        (
            "staleness.png",
            lambda: plot_staleness(metrics, out / "staleness.png"),
            f"no {STALENESS_HIST_PREFIX}<k> or staleness_max values",
        ),
        (
            "mismatch.png",
            lambda: plot_mismatch(metrics, out / "mismatch.png"),
            f"none of {', '.join(MISMATCH_KEYS)} in metrics.jsonl",
        ),
        (
            "timeline.png",
            lambda: plot_timeline(spans, out / "timeline.png"),
            "no timeline.<process>.jsonl spans",
        ),
    ]
    written: list[Path] = []
    for name, job, why in jobs:
        path = job()
        if path is None:
            log(f"skipped {name}: {why}")
        else:
            written.append(path)
    return written
