"""Run telemetry: metrics.jsonl writer, progress line, timeline spans, run plots."""

from __future__ import annotations

import asyncio
import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from run_dirs_for_tests import assert_png as _assert_png
from run_dirs_for_tests import step_metrics as _step_metrics
from run_dirs_for_tests import write_run as _write_run

from moerl.telemetry.metrics import (
    MetricsWriter,
    read_metrics,
)
from moerl.telemetry.plots import assign_lanes, plot_run, staleness_counts
from moerl.telemetry.progress import Progress, format_line
from moerl.telemetry.timeline import Timeline, load_timeline

REPO = Path(__file__).resolve().parents[2]


# --- MetricsWriter -----------------------------------------------------------------


def test_writer_round_trip(tmp_path):
    with MetricsWriter(tmp_path) as w:
        for step in range(3):
            w.log(step, {**_step_metrics(step), "count": np.int64(7), "x": np.float32(0.5)})
        w.log(3, {"reward_mean": float("nan")})  # non-finite → null, file stays strict JSON
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 4
    entries = [json.loads(line) for line in lines]  # every line is one JSON object
    assert entries == read_metrics(tmp_path)
    assert [e["step"] for e in entries] == [0, 1, 2, 3]
    assert entries[2]["reward_mean"] == pytest.approx(0.2)
    assert entries[1]["count"] == 7 and entries[1]["x"] == 0.5
    assert entries[3]["reward_mean"] is None
    assert all(isinstance(e["wall_time"], float) for e in entries)


def test_writer_truncate_after_and_resume(tmp_path):
    with MetricsWriter(tmp_path) as w:
        for step in range(5):
            w.log(step, _step_metrics(step))
    # A resumed run restarting at step 3 must not see steps 3, 4 twice.
    with MetricsWriter(tmp_path, resume_step=3) as w:
        assert [e["step"] for e in read_metrics(tmp_path)] == [0, 1, 2]
        w.log(3, {"reward_mean": 9.0})
        w.log(4, {"reward_mean": 9.5})
    entries = read_metrics(tmp_path)
    assert [e["step"] for e in entries] == [0, 1, 2, 3, 4]
    assert entries[3]["reward_mean"] == 9.0
    # truncate_after on an open writer: later appends continue the truncated file.
    with MetricsWriter(tmp_path) as w:
        assert w.truncate_after(2) == 3
        w.log(2, {"reward_mean": -1.0})
    assert [e["step"] for e in read_metrics(tmp_path)] == [0, 1, 2]


def test_writer_repairs_crash_cut_line(tmp_path):
    with MetricsWriter(tmp_path) as w:
        w.log(0, _step_metrics(0))
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 1, "rew')  # the process died mid-write
    assert [e["step"] for e in read_metrics(tmp_path)] == [0]
    with MetricsWriter(tmp_path) as w:
        w.log(1, _step_metrics(1))
    assert [e["step"] for e in read_metrics(tmp_path)] == [0, 1]


def test_writer_errors(tmp_path):
    with MetricsWriter(tmp_path) as w:
        with pytest.raises(ValueError, match="needs a step"):
            w.log(None, {"reward_mean": 1.0})
        w.log(None, {"step": 0, "reward_mean": 1.0})  # step inside metrics is fine
        with pytest.raises(ValueError, match="strictly increase"):
            w.log(0, {"reward_mean": 2.0})
        with pytest.raises(ValueError, match="disagrees"):
            w.log(1, {"step": 2})
        with pytest.raises(TypeError, match="'name' must be a number"):
            w.log(1, {"name": "abc"})
    with pytest.raises(FileNotFoundError, match="metrics.jsonl not found"):
        read_metrics(tmp_path / "nowhere")


@pytest.mark.parametrize(
    "flag, blocked, hint",
    [
        ("tensorboard", "torch.utils.tensorboard", "pip install tensorboard"),
        ("wandb", "wandb", "pip install wandb"),
    ],
)
def test_writer_missing_optional_package(tmp_path, monkeypatch, flag, blocked, hint):
    monkeypatch.setitem(sys.modules, blocked, None)  # makes `import blocked` raise ImportError
    with pytest.raises(ImportError, match=hint):
        MetricsWriter(tmp_path, **{flag: True})


# --- Progress ----------------------------------------------------------------------


def test_progress_plain_lines_when_not_a_tty(capsys):
    now = [0.0]
    p = Progress(10, min_interval_s=5.0, clock=lambda: now[0])
    assert not p.tty  # capsys' stdout is no terminal
    for step in range(1, 11):
        p.update(step, {**_step_metrics(step), "buffer_size": 4, "buffer_capacity": 16})
        now[0] += 2.0  # an update every 2 s, a line at most every 5 s
    p.close()
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" | ")[0] for line in lines] == [
        "step 1/10",
        "step 4/10",
        "step 7/10",
        "step 10/10",
    ]
    assert lines[-1] == (
        "step 10/10 | reward 1.000 | 1.01k tok/s | stale<=1 | buffer 4/16 | trainer idle 25% "
        "| 1.80 s/step | 0:18 elapsed | ETA 0:00"
    )
    assert lines[1].endswith("| 1.50 s/step | 0:06 elapsed | ETA 0:09")  # step 4 at 6 s


def test_progress_close_flushes_held_back_line(capsys):
    now = [0.0]
    p = Progress(10, min_interval_s=1e9, clock=lambda: now[0])
    p.update(1, {"reward_mean": 0.5})
    now[0] = 3725.0
    p.update(2, {"reward_mean": 0.6})  # throttled
    p.close()
    assert capsys.readouterr().out.splitlines() == [
        "step 1/10 | reward 0.500 | 0.00 s/step | 0:00 elapsed | ETA 0:00",
        "step 2/10 | reward 0.600 | 1862.50 s/step | 1:02:05 elapsed | ETA 4:08:20",
    ]
    assert format_line(3, 5, {"buffer_occupancy": 0.5}) == "step 3/5 | buffer 50%"
    assert format_line(3, 5, {"buffer/occupancy": 0.25}) == "step 3/5 | buffer 25%"


def test_progress_rich_at_a_tty():
    buf = io.StringIO()
    with Progress(4, stream=buf, tty=True) as p:
        for step in range(1, 5):
            p.update(step, {"reward_mean": 0.25})
    out = buf.getvalue()
    assert "4/4" in out and "reward 0.250" in out


# --- Timeline ----------------------------------------------------------------------


def test_timeline_concurrent_asyncio_spans(tmp_path):
    gen = Timeline(tmp_path, "engine0")
    trainer = Timeline(tmp_path, "trainer")

    async def request(i: int) -> None:
        async with gen.span("generate", rid=i) as span:
            await asyncio.sleep(0.01 * (i % 3 + 1))
            span.attrs["tokens"] = 10 * i

    async def main() -> None:
        with trainer.span("train", step=0):
            await asyncio.gather(*(request(i) for i in range(8)))
        with pytest.raises(RuntimeError):
            with trainer.span("sync", version=1):
                raise RuntimeError("broadcast failed")

    asyncio.run(main())
    gen.close()
    trainer.close()

    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "timeline.engine0.jsonl",
        "timeline.trainer.jsonl",
    ]
    spans = load_timeline(tmp_path)
    assert [s["start"] for s in spans] == sorted(s["start"] for s in spans)
    gens = [s for s in spans if s["kind"] == "generate"]
    assert sorted(s["rid"] for s in gens) == list(range(8))
    assert all(s["process"] == "engine0" and s["end"] >= s["start"] for s in gens)
    assert {s["rid"]: s["tokens"] for s in gens} == {i: 10 * i for i in range(8)}
    # all eight requests ran at once, so their spans overlap (the plot stacks them)
    assert max(s["start"] for s in gens) < min(s["end"] for s in gens)
    assert len(set(assign_lanes(gens))) == 8
    (train,) = [s for s in spans if s["kind"] == "train"]
    assert train["step"] == 0 and train["start"] <= min(s["start"] for s in gens)
    (sync,) = [s for s in spans if s["kind"] == "sync"]
    assert sync["error"] == "RuntimeError" and sync["version"] == 1


def test_timeline_validation(tmp_path):
    with pytest.raises(ValueError, match="process name"):
        Timeline(tmp_path, "bad/name")
    tl = Timeline(tmp_path, "t")
    with pytest.raises(ValueError, match="reserved"):
        tl.span("train", start=1.0)
    off = Timeline(tmp_path, "off", enabled=False)
    with off.span("train"):
        pass
    assert not (tmp_path / "timeline.off.jsonl").exists()
    assert assign_lanes(
        [{"start": 0, "end": 2}, {"start": 1, "end": 3}, {"start": 2, "end": 4}]
    ) == [0, 1, 0]


# --- plots -------------------------------------------------------------------------


def test_plot_run_writes_pngs(tmp_path):
    run = tmp_path / "run"
    _write_run(run)
    assert staleness_counts(read_metrics(run)) == {0: 300.0, 1: 75.0, 3: 6.0}
    written = plot_run(run, tmp_path / "plots", log=lambda msg: None)
    names = ["reward.png", "staleness.png", "mismatch.png", "timeline.png"]
    assert [p.name for p in written] == names
    for path in written:
        _assert_png(path)


def test_plot_run_skips_absent_data(tmp_path):
    with MetricsWriter(tmp_path) as w:
        for step in range(3):
            w.log(step, _step_metrics(step))
    messages: list[str] = []
    written = plot_run(tmp_path, log=messages.append)
    # no staleness_hist keys → staleness_max histogram; no mismatch keys; no timeline
    assert [p.name for p in written] == ["reward.png", "staleness.png"]
    assert len(messages) == 2
    assert messages[0].startswith("skipped mismatch.png") and "mismatch/routing" in messages[0]
    assert messages[1].startswith("skipped timeline.png")
    for path in written:
        _assert_png(path)


def test_a_stall_of_zero_reward_spread_is_named_once_with_its_cause():
    """telemetry.stall_warn_steps: the warning comes at the N-th step in a row whose every
    group had no reward spread, not before and not again while it lasts; a step with
    spread starts the count over; the cause follows the metrics (all truncated, all
    zero, all alike); 0 never warns; a run without the metric is left alone."""
    from moerl.telemetry.runlog import ZERO_SPREAD, StallWatch

    cut = {ZERO_SPREAD: 1.0, "reward_mean": 0.0, "response_truncated_frac": 1.0,
           "reward_zero_frac": 1.0}  # fmt: skip
    watch = StallWatch(3)
    said = [watch.update(step, cut) for step in range(5)]
    assert said[:2] == [None, None] and said[3:] == [None, None]
    assert said[2] is not None and said[2].startswith("steps 0-2: no group had any spread")
    assert "rollout.max_new_tokens" in said[2] and "telemetry.stall_warn_steps=3" in said[2]
    assert watch.update(5, {**cut, ZERO_SPREAD: 0.75}) is None  # learning again
    zero = {**cut, "response_truncated_frac": 0.5}
    said = [watch.update(step, zero) for step in range(6, 9)]
    assert said[:2] == [None, None] and "every reward was 0" in said[2]
    alike = {ZERO_SPREAD: 1.0, "reward_mean": 1.0, "reward_zero_frac": 0.0}
    fresh = StallWatch(1)
    assert "scored the same" in fresh.update(0, alike)
    assert StallWatch(0).update(0, cut) is None
    assert StallWatch(1).update(0, {"reward_mean": 0.0}) is None


def test_the_run_log_warns_of_a_stall_on_the_console(tmp_path, caplog):
    """RunLog (the loop's writer) feeds every metrics line to the StallWatch and logs its
    warning; the lines are written as ever."""
    import logging

    import numpy as np
    from hydra import compose, initialize_config_module

    from moerl.common.trajectory import Trajectory
    from moerl.config.store import register_configs
    from moerl.telemetry.runlog import ZERO_SPREAD, RunLog
    from moerl.validate import validate_config

    register_configs()
    with initialize_config_module(config_module="moerl.conf", version_base="1.3"):
        dc = compose(config_name="config", overrides=["telemetry.stall_warn_steps=2"])
    cfg = validate_config(dc, world_size=1)
    cut = [
        Trajectory(
            np.array([1, 2]),
            np.array([3]),
            np.array([-1.0], np.float32),
            np.array([0]),
            finish_reason="length",
            reward=0.0,
        )  # fmt: skip
        for _ in range(4)
    ]
    run_log = RunLog(cfg, tmp_path, 0)
    try:
        with caplog.at_level(logging.WARNING, logger="moerl.telemetry.runlog"):
            for step in range(2):
                run_log.log(step, cut, {ZERO_SPREAD: 1.0}, version=1, wall_s=0.1, wait_s=0.0)
    finally:
        run_log.close()
    (said,) = [r.getMessage() for r in caplog.records]
    assert said.startswith("steps 0-1: no group had any spread") and "max_new_tokens" in said
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
