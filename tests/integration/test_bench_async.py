"""tools/bench/async_vs_sync.py runs end to end (smallest settings), so it cannot rot.
The speed target is printed by the benchmark, never asserted here."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # two full runs of the main job (~45 s)
def test_async_vs_sync_benchmark_quick(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location(
        "bench_async_vs_sync", ROOT / "tools" / "bench" / "async_vs_sync.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)  # type: ignore[union-attr]
    # 3 steps: the recipe's 2 warmup steps must be shorter than the schedule
    results = bench.main(["--quick", "--steps", "3", "--out", str(tmp_path)])
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("sync_s=")]
    assert len(line) == 1 and "speedup=" in line[0] and "trainer_idle_async=" in line[0]
    assert results["sync"]["steps"] == results["async"]["steps"] == 3
    assert results["sync"]["staleness_max"] == 0.0
    assert results["sync"]["loop_s"] > 0 and results["async"]["loop_s"] > 0
    assert results["len_p90"] >= 5 * results["len_p50"]
    assert json.loads((tmp_path / "result.json").read_text())["speedup"] == results["speedup"]
    assert (tmp_path / "timeline_sync.png").is_file()
    assert (tmp_path / "timeline_async.png").is_file()
