"""Run directories for the telemetry tests: a metrics.jsonl and timelines as a run
writes them, and a PNG check (tests/unit/test_telemetry.py,
tests/integration/test_plot_run_cli.py)."""

from __future__ import annotations

from pathlib import Path

from moerl.telemetry.metrics import MetricsWriter, staleness_hist_metrics
from moerl.telemetry.timeline import Timeline

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def step_metrics(step: int) -> dict[str, float]:
    return {
        "reward_mean": 0.1 * step,
        "staleness_max": float(step % 3),
        "tokens_per_s": 1000.0 + step,
        "trainer_idle_frac": 0.25,
        "mismatch_k3": 1e-3,
    }


def write_run(run_dir: Path) -> None:
    with MetricsWriter(run_dir) as w:
        for step in range(6):
            w.log(
                step,
                {
                    **step_metrics(step),
                    "time_s": 2.0 * step,
                    "mismatch/routing": 1e-3,
                    "mismatch/sampling_mask": 4e-4,
                    "mismatch/staleness": 2e-4,
                    "mismatch/numerics": 1e-4,
                    **staleness_hist_metrics({0: 50, 1: 10 + step, 3: 1}),
                },
            )
    tl = Timeline(run_dir, "trainer")
    for step in range(3):
        tl.record("train", 100.0 + step, 100.5 + step, step=step)
        tl.record("sync", 100.5 + step, 100.6 + step)
    eng = Timeline(run_dir, "engine0")
    for i in range(4):
        eng.record("generate", 100.0 + 0.3 * i, 101.5 + 0.3 * i, rid=i)
    tl.close()
    eng.close()


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert len(data) > 1000 and data[:8] == PNG_MAGIC, path
