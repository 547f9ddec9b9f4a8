"""tools/bench/episodes.py runs end to end (quick settings), so it cannot rot. The speed
target is printed by the benchmark, never asserted here."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KEYS = ("episodes_per_s_sync", "episodes_per_s_async", "speedup", "trainer_idle_async")


@pytest.mark.slow  # two training runs with env waits, then two engines (~90 s)
def test_episodes_benchmark_quick(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location(
        "bench_episodes", ROOT / "tools" / "bench" / "episodes.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)  # type: ignore[union-attr]
    # 3 steps: the recipe's 2 warmup steps must be shorter than the schedule
    results = bench.main(
        ["--quick", "--steps", "3", "--turn-episodes", "1", "--out", str(tmp_path)]
    )
    lines = [
        x for x in capsys.readouterr().out.splitlines() if x.startswith("episodes_per_s_sync=")
    ]
    assert len(lines) == 1
    fields = dict(re.findall(r"(\w+)=(\S+)", lines[0]))
    assert list(fields)[: len(KEYS)] == list(KEYS)  # the headline keys come first, in order
    for key in KEYS:
        assert float(fields[key]) >= 0, key
    for key in ("episodes_per_s_sync", "episodes_per_s_async", "speedup"):
        assert float(fields[key]) > 0, key
    prefix = fields["turn_prefix_reuse_speedup"]
    assert prefix == "n/a" or float(prefix) > 0
    assert float(fields["env_latency_p90"]) >= 5 * float(fields["env_latency_p50"])
    for name in ("sync", "async"):
        run = results[name]
        assert run["steps"] == 3 and run["episodes"] == 3 * 8
        assert run["episode_turns_mean"] > 1  # multi-turn episodes
        assert run["episode_env_step_s"] > 0  # the env waited
    assert results["sync"]["staleness_max"] == 0.0
    assert json.loads((tmp_path / "result.json").read_text())["speedup"] == results["speedup"]
