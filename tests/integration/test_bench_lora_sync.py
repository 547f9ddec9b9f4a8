"""tools/bench/lora_sync.py runs end to end (tiny config, one repeat), so it cannot rot.
The speed targets are printed by the benchmark, never asserted here.

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
LINE = re.compile(
    r"^model=(?P<model>\w+) transport=(?P<transport>\w+) rank=(?P<rank>\d+) "
    r"full_bytes=(?P<full_bytes>\d+) "
    r"adapter_bytes=(?P<adapter_bytes>\d+) bytes_ratio=(?P<bytes_ratio>[\d.]+) "
    r"full_sync_s=(?P<full_sync_s>[\d.]+) adapter_sync_s=(?P<adapter_sync_s>[\d.]+) "
    r"time_ratio=(?P<time_ratio>[\d.]+)$"
)


@pytest.mark.slow  # out of the default run (the suite's 20-minute budget)
def test_lora_sync_benchmark_quick(tmp_path):
    script = ROOT / "tools" / "bench" / "lora_sync.py"
    run = subprocess.run(
        [sys.executable, str(script), "--quick", "--rank", "8", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = [m for m in map(LINE.match, run.stdout.splitlines()) if m is not None]
    assert [m["transport"] for m in lines] == ["tensors", "directory"], run.stdout
    result = json.loads((tmp_path / "result.json").read_text())["tiny"]
    for match in lines:
        got = match.groupdict()
        assert got["model"] == "tiny" and int(got["rank"]) == 8
        full, adapter = int(got["full_bytes"]), int(got["adapter_bytes"])
        assert 0 < adapter < full
        assert float(got["full_sync_s"]) > 0 and float(got["adapter_sync_s"]) > 0
        assert (result["full_bytes"], result["adapter_bytes"]) == (full, adapter)
        phases = result["transports"][got["transport"]]["phases_s"]
        assert set(phases) == {"gather_s", "load_s", "unload_s"}
    # every routed expert of every MoE layer has its own A and B for each projection
    assert result["adapter_tensors"] > 2 * 3 * 8 * 3
