"""Nothing outlives the launcher: a SIGKILL of its main process alone takes its trainer
rank and the engine down, and a failed launch leaves nothing in the temp folder."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

QUIET = ["telemetry.progress_interval_s=1000"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"}
    return {**env, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1", **extra}


def _reap(proc: subprocess.Popen, family: list[psutil.Process]) -> None:
    """Whatever a failed test left running: the launcher and its descendants."""
    for p in family:
        if p.is_running():
            p.kill()
    if proc.poll() is None:
        proc.kill()


def _ignore_sigint() -> None:
    # as for `python -m moerl.launch ... &` in a script: background jobs of a
    # non-interactive shell start with SIGINT ignored, and so do their children
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.slow
def test_sigkill_of_the_launcher_leaves_no_process(tmp_path):
    run = tmp_path / "killed"
    run.mkdir()
    args = [sys.executable, "-m", "moerl.launch", "+recipe=deepseek_moe", *QUIET,
            f"hydra.run.dir={run}", "trainer.train_iters=200"]  # fmt: skip
    proc = subprocess.Popen(args, cwd=tmp_path, env=_env(), start_new_session=True,
                            preexec_fn=_ignore_sigint, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    family: list[psutil.Process] = []
    try:
        deadline = time.time() + 300
        while not (run / "metrics.jsonl").exists():  # a step done: rank and engine are up
            assert proc.poll() is None and time.time() < deadline, "the run did not start"
            time.sleep(0.2)
        family = psutil.Process(proc.pid).children(recursive=True)
        assert any("moerl.engine" in p.cmdline() for p in family)
        os.kill(proc.pid, signal.SIGKILL)  # the launcher's main process only
        proc.wait()
        _, alive = psutil.wait_procs(family, timeout=60)
        assert not alive, [p.cmdline()[:4] for p in alive]
    finally:
        _reap(proc, family)


@pytest.mark.slow
def test_a_failed_launch_leaves_nothing_in_tmp(tmp_path):
    """Rank 0 fails (its engine cannot become healthy in 10 ms): the error reaches the
    console, and torch's per-rank error files do not stay behind."""
    run, temp = tmp_path / "failed", tmp_path / "tmp"
    temp.mkdir()
    args = [sys.executable, "-m", "moerl.launch", "+recipe=deepseek_moe", *QUIET,
            f"hydra.run.dir={run}", "engine.startup_timeout_s=0.01"]  # fmt: skip
    out = subprocess.run(args, cwd=tmp_path, env=_env(TMPDIR=str(temp)), capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert out.returncode != 0
    assert "did not become healthy" in out.stderr, out.stderr[-3000:]
    # torch makes its (here empty) compile-cache folder torchinductor_$USER when
    # megatron-core is imported: a cache shared by every run, not one run's litter
    left = [p for p in Path(temp).rglob("*") if p.is_file() or not p.name.startswith("torch")]
    assert left == []


@pytest.mark.slow
def test_sigint_of_the_launcher_alone_stops_its_ranks_and_exits(tmp_path):
    """Issue 31: ``kill -INT`` of the launcher printed "ranks and engines stopped" while
    its rank trained on, and the launcher waited for it (until a SIGTERM)."""
    run = tmp_path / "interrupted"
    run.mkdir()
    args = [sys.executable, "-m", "moerl.launch", "+recipe=deepseek_moe", *QUIET,
            f"hydra.run.dir={run}", "trainer.train_iters=500"]  # fmt: skip
    proc = subprocess.Popen(args, cwd=tmp_path, env=_env(), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    family: list[psutil.Process] = []
    try:
        deadline = time.time() + 300
        while not (run / "metrics.jsonl").exists():
            assert proc.poll() is None and time.time() < deadline, "the run did not start"
            time.sleep(0.2)
        family = psutil.Process(proc.pid).children(recursive=True)
        os.kill(proc.pid, signal.SIGINT)  # the launcher's main process only
        _, err = proc.communicate(timeout=60)  # it ends, not waits for its ranks
        assert proc.returncode == 130, err[-3000:]
        assert "interrupted; ranks and engines stopped" in err
        _, alive = psutil.wait_procs(family, timeout=5)  # already gone: it said so
        assert not alive, [p.cmdline()[:4] for p in alive]
    finally:
        _reap(proc, family)
