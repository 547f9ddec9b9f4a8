"""`python -m moerl.launch` as a user runs it (a subprocess): --help, a dry run, and
configs refused before any rank or engine starts."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tiny_hf_for_tests import hf_dir as _hf_dir

from moerl.config.threads import MALLOC_ENV


def _launch(run: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """moerl.launch with ``args`` in ``run``'s parent (Hydra's run dir: ``run``), outside
    any torchrun environment."""
    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"}
    return subprocess.run(
        [sys.executable, "-m", "moerl.launch", f"hydra.run.dir={run}", *args],
        cwd=run.parent, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_launch_help(tmp_path) -> None:
    proc = _launch(tmp_path / "run", "--help")
    assert proc.returncode == 0, proc.stderr
    assert "python -m moerl.launch" in proc.stdout
    assert "parallel: " in proc.stdout and "tp2ep2" in proc.stdout
    # every key with its type, value and the docstring under its dataclass field
    assert "trainer.lr: float = " in proc.stdout
    assert "Peak learning rate of the optimizer." in proc.stdout
    assert "launcher.dry_run: bool = false" in proc.stdout
    assert not (tmp_path / "run").exists()


def test_launch_help_follows_the_composition(tmp_path) -> None:
    """--help with a recipe and a group option lists that composition's keys and values."""
    proc = _launch(tmp_path / "run", "+recipe=deepseek_moe", "task=arithmetic", "--help")
    assert proc.returncode == 0, proc.stderr
    assert "task (ArithmeticTaskConfig)" in proc.stdout
    assert "task.max_operand: int = " in proc.stdout
    assert "model.family: str = deepseek_moe" in proc.stdout


def test_dry_run_writes_nothing(tmp_path) -> None:
    """A dry run composes and checks the config without Hydra's job runner: no run
    directory, no `.hydra/` snapshot, no log file, in the working directory or elsewhere."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"}
    for args in (
        ["+recipe=deepseek_moe", "launcher.dry_run=true"],
        ["+recipe=deepseek_moe", "launcher.dry_run=true", f"hydra.run.dir={tmp_path / 'run'}"],
        ["+recipe=deepseek_moe", "launcher.dry_run=true", "parallel=tp2", "launcher.nproc=3"],
        ["launcher.dry_run=true", "task.no_such_key=1"],
    ):
        subprocess.run(
            [sys.executable, "-m", "moerl.launch", *args],
            cwd=cwd, env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cwd"]
    assert list(cwd.iterdir()) == []


def test_dry_run_of_a_bad_override_is_one_line(tmp_path) -> None:
    proc = _launch(tmp_path / "run", "launcher.dry_run=true", "task.no_such_key=1")
    assert proc.returncode == 2
    assert "task.no_such_key" in proc.stderr and "Traceback" not in proc.stderr


def test_launch_valid_config(tmp_path) -> None:
    proc = _launch(
        tmp_path / "run", "model=deepseek_moe_tiny", "parallel=ep2", "launcher.nproc=2",
        "launcher.dry_run=true",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "ep: 2" in proc.stdout
    assert "dry run, nothing started" in proc.stdout


def test_launch_rejects_bad_world_size(tmp_path) -> None:
    proc = _launch(tmp_path / "run", "parallel=tp2", "launcher.nproc=3")
    assert proc.returncode != 0
    assert "world size 3" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_launch_refuses_before_any_rank_starts(tmp_path) -> None:
    """A real launch (not a dry run) of a config that today fails after 25 s, once the
    model is written and an engine is up, stops at once: no model, no engine log."""
    run = tmp_path / "run"
    t0 = time.time()
    proc = _launch(run, "trainer.global_batch_size=12")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "invalid config: trainer.global_batch_size=12" in proc.stderr
    assert not (run / "init_hf").exists() and not list(run.glob("engine*.log"))
    assert time.time() - t0 < 60


def test_a_refused_launch_stops_the_engine_it_started_to_wait_for_the_checks(tmp_path) -> None:
    """The launcher starts its engine with --await-start before the checks import torch
    (moerl.launch.warm_engines); a config the checks refuse stops it, unstarted."""
    import psutil

    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "moerl.launch", f"hydra.run.dir={run}", "trainer.global_batch_size=12"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    waiting: list[tuple[psutil.Process, list[str]]] = []
    launcher = psutil.Process(proc.pid)
    while proc.poll() is None and not waiting:
        try:
            children = [(c, c.cmdline()) for c in launcher.children()]
            waiting = [(c, cmd) for c, cmd in children if "--await-start" in cmd]
        except psutil.Error:  # a child that came and went, or the launcher itself
            pass
        time.sleep(0.01)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "invalid config: trainer.global_batch_size=12" in err
    assert waiting, "the launcher started no engine before its checks"
    engine, cmdline = waiting[0]
    assert str(run / "init_hf") in cmdline  # the engine it would have started
    assert not engine.is_running()
    assert not (run / "init_hf").exists() and not list(run.rglob("engine*.log"))


def test_dry_run_reads_the_checkpoints_config(tmp_path) -> None:
    ckpt = _hf_dir(tmp_path / "hf", num_experts=6, moe_router_num_groups=2)
    proc = _launch(
        tmp_path / "run", "+recipe=deepseek_moe", f"model.path={ckpt}", "parallel.ep=4",
        "launcher.nproc=4", "launcher.dry_run=true",
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout[-2000:]
    assert "parallel.ep=4" in proc.stderr and "dry run" not in proc.stdout


_FIRST_TORCH_IMPORT = """
import builtins, os, sys
seen = []
load = builtins.__import__
def spy(name, *args, **kwargs):
    if name == "torch" and "torch" not in sys.modules and not seen:
        seen.append(os.environ.get("GOMP_SPINCOUNT"))
        seen.append(os.environ.get("MALLOC_TRIM_THRESHOLD_"))
    return load(name, *args, **kwargs)
builtins.__import__ = spy
from moerl.launch import main
sys.argv = ["moerl.launch", *sys.argv[1:]]
main()
print("MALLOC_TRIM_THRESHOLD_ when torch loaded:", seen[1] if seen else "torch not loaded")
print("GOMP_SPINCOUNT when torch loaded:", seen[0] if seen else "torch not loaded")
"""


def test_the_launcher_sets_the_openmp_spin_count_before_torch_loads(tmp_path) -> None:
    """libgomp reads GOMP_SPINCOUNT once, as torch loads it: the launcher's setting counts
    only if it comes before the preflight's first torch import (a dry run of a recipe
    imports torch there). The user's environment wins; null leaves libgomp's default.
    glibc's malloc tuning (launcher.malloc_keep_mb) is in the environment by then too, for
    the processes the run starts."""

    def at_torch(n: int, case: tuple[tuple[str, ...], dict[str, str]]) -> tuple[str, str]:
        """(GOMP_SPINCOUNT, MALLOC_TRIM_THRESHOLD_) as torch loaded in dry run ``n``."""
        args, env = case
        clean = {
            k: v
            for k, v in os.environ.items()
            if k not in ("WORLD_SIZE", "GOMP_SPINCOUNT", "OMP_WAIT_POLICY", *MALLOC_ENV)
        }
        run = tmp_path / f"run{n}"
        out = subprocess.run(
            [sys.executable, "-c", _FIRST_TORCH_IMPORT, f"hydra.run.dir={run}",
             "+recipe=deepseek_moe", "launcher.dry_run=true", *args],
            cwd=tmp_path, env={**clean, **env}, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        lines = out.stdout.strip().splitlines()
        return lines[-1].rsplit(": ", 1)[1], lines[-2].rsplit(": ", 1)[1]

    cases: list[tuple[tuple[str, ...], dict[str, str]]] = [
        ((), {}),
        (("launcher.omp_spincount=2000",), {}),
        ((), {"GOMP_SPINCOUNT": "7"}),
        ((), {"OMP_WAIT_POLICY": "passive"}),
        (("launcher.omp_spincount=null",), {}),
        (("launcher.malloc_keep_mb=0",), {}),
    ]
    with ThreadPoolExecutor(3) as pool:  # six dry runs, each a process of its own
        (spin, malloc), *others = pool.map(at_torch, range(len(cases)), cases)
    assert spin == "50000"
    assert [s for s, _ in others] == ["2000", "7", "None", "None", "50000"]
    if sys.platform.startswith("linux"):  # glibc
        assert malloc == str(256 << 20)
        assert others[-1][1] == "None"
