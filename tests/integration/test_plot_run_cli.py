"""tools/plot_run.py as a user runs it (a subprocess)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from run_dirs_for_tests import assert_png as _assert_png
from run_dirs_for_tests import write_run as _write_run

REPO = Path(__file__).resolve().parents[2]


def test_plot_run_cli(tmp_path):
    run = tmp_path / "run"
    _write_run(run)
    out = tmp_path / "out"
    cmd = [sys.executable, str(REPO / "tools" / "plot_run.py"), str(run), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    printed = [Path(line) for line in proc.stdout.splitlines()]
    assert [p.name for p in printed] == [
        "reward.png",
        "staleness.png",
        "mismatch.png",
        "timeline.png",
    ]
    for path in printed:
        assert path.parent == out
        _assert_png(path)
    # a directory without metrics.jsonl: clear message, non-zero exit
    proc = subprocess.run(
        cmd[:2] + [str(tmp_path / "empty")], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2 and "metrics.jsonl not found" in proc.stderr
