"""tools/bench/replay_overhead.py runs end to end (smallest settings), so it cannot rot.
The overhead target is printed by the benchmark, never asserted here.

It runs as a child process: the benchmark makes its own process a one-rank gloo world
with megatron-core's parallel state, which must not leak into the test process."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NUMBER = r"-?[\d.]+"
LINE = re.compile(
    rf"^step_on_s=(?P<on>{NUMBER}) step_off_s=(?P<off>{NUMBER}) overhead=(?P<overhead>{NUMBER})"
)


@pytest.mark.slow  # out of the default run (the suite's 20-minute budget)
def test_replay_overhead_benchmark_smallest(tmp_path):
    script = ROOT / "tools" / "bench" / "replay_overhead.py"
    run = subprocess.run(
        [sys.executable, str(script), "--quick", "--prompts", "4", "--new-tokens", "8",
         "--reps", "1", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = [m for m in map(LINE.match, run.stdout.splitlines()) if m is not None]
    assert len(lines) == 1, run.stdout
    on, off, overhead = (float(lines[0][k]) for k in ("on", "off", "overhead"))
    assert on > 0 and off > 0
    assert abs(overhead - (on / off - 1)) < 2e-3  # printed values are rounded
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["rollouts"] == 4 and result["reps"] == 1
    assert len(result["step_on_s_all"]) == len(result["step_off_s_all"]) == 1
    assert result["overhead"] == result["step_on_s"] / result["step_off_s"] - 1
