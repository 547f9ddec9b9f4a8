"""tools/bench/offpolicy.py runs end to end at its smallest (three two-step training runs
at one staleness bound), so it cannot rot: one summary line per variant, and the former
composition's custom loss loads from the bench by ``_target_``."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINE = re.compile(
    r"^staleness=1 variant=(?P<variant>\w+) reward_last5=\S+ abs_log_ratio=\S+ "
    r"is_weight_max=(?P<wmax>\S+) clipped_frac=\S+ step_s=\S+$"
)


@pytest.mark.slow
def test_offpolicy_benchmark_smallest(tmp_path):
    script = ROOT / "tools" / "bench" / "offpolicy.py"
    run = subprocess.run(
        [sys.executable, str(script), "--steps", "3", "--staleness", "1", "--batch", "16",
         "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = {m["variant"]: m for m in map(LINE.match, run.stdout.splitlines()) if m}
    assert set(lines) == {"bypass", "recompute", "former"}
    assert float(lines["bypass"]["wmax"]) == 1.0  # bypass reweights nothing
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["steps"] == 3 and len(result["1/former"]["reward"]) == 3
