"""The console of a launch shows moerl's lines, the progress line and warnings; the
libraries' INFO logs (megatron-core lists every parameter of every gradient bucket) and
progress bars go to the run directory's logs/ instead, unless telemetry.console_level
asks for them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# a megatron-core INFO record as Hydra's job logging and moerl's rank logging format it
MEGATRON_INFO = re.compile(r"\]\[megatron[\w.]*\]\[INFO\] - ")


def _torchrun(run_dir: Path, *overrides: str) -> str:
    """stdout and stderr of a two-step tiny run as one torchrun rank (Hydra configures
    INFO logging in a torchrun rank, so that is where the flood showed)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1",
           "-m", "moerl.launch", "+recipe=deepseek_moe", f"hydra.run.dir={run_dir}",
           "trainer.train_iters=2", "trainer.lr_warmup_steps=0", "telemetry.flip_every=0",
           "telemetry.decompose_every=0", *overrides]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1"}
    proc = subprocess.run(
        cmd, cwd=run_dir.parent, env=env, capture_output=True, text=True, timeout=600
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    return out


@pytest.mark.slow
def test_console_is_quiet_and_the_full_log_is_in_the_run_dir(tmp_path):
    run = tmp_path / "quiet"
    out = _torchrun(run)
    assert "moerl: done, step 2" in out and "step 2/2" in out
    assert not MEGATRON_INFO.search(out), out[-3000:]
    assert "Writing model shards" not in out
    assert MEGATRON_INFO.search((run / "logs" / "rank0.log").read_text())
    assert (run / "logs" / "engine0.log").stat().st_size > 0

    loud = _torchrun(tmp_path / "loud", "telemetry.console_level=info")
    assert MEGATRON_INFO.search(loud) and "moerl: done, step 2" in loud
