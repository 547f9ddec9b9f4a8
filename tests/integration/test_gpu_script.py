"""tools/gpu/run.py, the GPU path of issue 28, runs its dry run here: every part's driver
on the CPU at tiny sizes, so the script a GPU machine runs cannot rot unseen."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools" / "gpu"))
from run import MAPPED, link_package, unlink_package  # noqa: E402

# the GPU image has these (KINDS.md); carrying them would replace its CUDA builds
NEVER_CARRIED = {"torch", "triton", "transformers", "numpy"}


@pytest.mark.slow  # out of the default run (the suite's 20-minute budget)
def test_dry_run_runs_every_part(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    argv = [sys.executable, str(REPO / "tools/gpu/run.py"), "--dry-run", "--out", str(out),
            "--work", str(work)]  # fmt: skip
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    parts = summary["parts"]
    assert sorted(parts, key=int) == [str(n) for n in range(1, 11)]
    assert {p["status"] for p in parts.values()} <= {"ok", "skipped"}, parts
    assert "skipped" in parts["1"]["results"]["pytest"]  # the kernels' GPU tests, collected
    assert parts["6"]["results"]["benches"] == {"kernels": "ok"}  # run_all's kernel section
    assert any(k.startswith("fused_logprobs") for k in parts["2"]["results"])
    assert parts["3"]["results"]["tiny/fp32"]["ok"]
    assert parts["5"]["results"]["steps"] == 2
    assert parts["8"]["results"]["steps"] == 2  # engine.cuda_graph=true: no graphs on the CPU
    top = parts["9"]["results"]  # issue 30's bench, quick, on the CPU
    assert top["device"] == "cpu" and top["abs_diff_max"] == 0
    assert top["engine_invariant"] == top["engine_scenarios"] == 6
    probe = parts["10"]["results"]  # every op of kernels/batch_invariant.py keeps its bits here
    assert probe["device"] == "cpu" and probe["invariant"] == "20/20", probe
    assert probe["differs"].get("torch_linear/float32"), probe  # the probe can see a change
    colocated = parts["7"]["results"]  # in one process, asleep through both steps
    assert colocated["steps"] == 2 and colocated["engine_slept_steps"] == 2
    assert colocated["onpolicy_log_ratio_abs_max"] < 1e-4
    # what comes back from the device machine: at most 8 files, names it accepts
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8 and all(re.fullmatch(r"[A-Za-z0-9._-]+", p.name) for p in files)
    logs = (out / "parts.log").read_text()  # every part's log, in order
    assert [int(n) for n in re.findall(r"^# part (\d+):", logs, re.M)] == list(range(1, 11))
    assert "=== summary ===" in proc.stdout


def test_package_links_give_moerl_its_mapped_folders(tmp_path):
    """setup.py's package_dir, without an install: moerl.kernels imports from the
    checkout's kernels/ with only the repo on sys.path, and the links go afterwards."""
    repo = tmp_path / "repo"
    for folder in ("moerl", *MAPPED.values()):
        (repo / folder).mkdir(parents=True)
        (repo / folder / "__init__.py").write_text(f"WHERE = {folder!r}\n")
    links = link_package(repo)
    code = "import moerl.kernels, moerl.conf, moerl.recipes; print(moerl.kernels.WHERE)"
    proc = subprocess.run([sys.executable, "-S", "-c", code], cwd=repo, capture_output=True,
                          text=True)  # fmt: skip
    assert proc.stdout.strip() == "kernels", proc.stderr
    assert link_package(repo) == []  # present already: nothing made
    unlink_package(links)
    assert not any((repo / "moerl" / name).exists() for name in MAPPED)


def test_wheel_list_is_pinned_and_leaves_the_image_alone():
    lines = (REPO / "tools/gpu/wheels.txt").read_text().splitlines()
    reqs = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    names = [r.split("==")[0].lower().replace("_", "-") for r in reqs]
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+==[0-9][A-Za-z0-9.]*", r) for r in reqs), reqs
    assert len(set(names)) == len(names)
    assert not NEVER_CARRIED & set(names)
    mcore = next(r for r in reqs if r.startswith("megatron-core=="))
    assert mcore.split("==")[1].startswith(("0.16.", "0.17.", "0.18."))  # setup.py's range


def test_engine_profile_runs_on_the_cpu(capsys):
    """tools/gpu/profile_engine.py (a GPU diagnostic) on the CPU: the engine's step time
    beside transformers' forward, and op counts from the scheduler thread's profile."""
    from profile_engine import main

    from moerl.engine.core.scheduler import Scheduler

    step = Scheduler._step
    got = main(["--device", "cpu", "--requests", "2", "--new-tokens", "20"])
    assert Scheduler._step is step  # the timing hook is removed again
    assert got["engine_step_ms"] > 0 and got["hf_step_ms"] > 0
    assert got["aten_ops_per_step"] > 100  # a decode step of 4 layers, not an empty profile
    assert "engine/hf" in capsys.readouterr().out


def test_environment_check_reads_setup_requirements():
    """check_env.py also checks moerl's own install_requires (read from setup.py without
    running it): orjson was missing on the GPU image and only an ImportError said so."""
    import check_env

    reqs = check_env.setup_requires()
    assert "orjson" in reqs and any(r.startswith("megatron-core") for r in reqs)
    assert check_env._unmet("x", ["pytest", "no-such-dist-moerl==1"]) == [
        "x needs no-such-dist-moerl==1: not installed"
    ]
    assert check_env._unmet("x", ["pytest<1"])[0].startswith("x needs pytest<1: found ")
