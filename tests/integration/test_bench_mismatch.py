"""tools/bench/mismatch.py runs end to end (smallest settings), so it cannot rot: the
four replay × mask settings on one bf16 rollout set, and the reduction line.

It runs as a child process (check_replay's scoring spawns its own gloo rank)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SETTING = re.compile(
    r"^replay=(?P<replay>on|off) mask=(?P<mask>on|off) flip_rate=(?P<flip>[\d.]+) "
    r"mismatch_k3=(?P<k3>\S+) mean_abs_dlogp=(?P<dlogp>\S+)$"
)
REDUCTION = re.compile(r"^reduction=(?P<reduction>[\d.]+|inf) ")


@pytest.mark.slow  # out of the default run (the suite's 20-minute budget)
def test_mismatch_benchmark_smallest(tmp_path):
    script = ROOT / "tools" / "bench" / "mismatch.py"
    run = subprocess.run(
        [sys.executable, str(script), "--quick", "--prompts", "4", "--new-tokens", "8",
         "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = run.stdout.splitlines()
    settings = {(m["replay"], m["mask"]): m for m in map(SETTING.match, out) if m is not None}
    assert set(settings) == {("on", "on"), ("on", "off"), ("off", "on"), ("off", "off")}
    assert float(settings[("on", "on")]["flip"]) == 0.0  # replay keeps every route
    reduction = [m for m in map(REDUCTION.match, out) if m is not None]
    assert len(reduction) == 1, run.stdout
    result = json.loads((tmp_path / "result.json").read_text())
    assert set(result["settings"]) == {
        "replay_on_mask_on", "replay_on_mask_off", "replay_off_mask_on", "replay_off_mask_off"
    }  # fmt: skip
    k3 = {k: v["mismatch_k3"] for k, v in result["settings"].items()}
    assert result["reduction"] == k3["replay_off_mask_off"] / k3["replay_on_mask_on"]
    assert f"{result['reduction']:.2f}" == reduction[0]["reduction"]
    assert result["replay_flip_rate"] == 0.0
    assert result["engine_dtype"] == "bfloat16" and result["rollouts"] == 4


GEOMETRY = re.compile(
    r"^geometry=(?P<name>\w+) engine=(?P<engine>\w+) flip_rate_off=(?P<off>[\d.]+) "
    r"flip_rate_on=(?P<on>[\d.]+) k3_off=(?P<k3_off>\S+) k3_on=(?P<k3_on>\S+) "
    r"reduction=(?P<reduction>[\d.]+|inf) routing_share=(?P<share>\S+)$"
)


@pytest.mark.slow  # ~2 min: the tiny study, then a 128- and a 256-expert model
def test_mismatch_at_the_router_geometries(tmp_path):
    script = ROOT / "tools" / "bench" / "mismatch.py"
    run = subprocess.run(
        [sys.executable, str(script), "--quick", "--prompts", "4", "--new-tokens", "8",
         "--geometries", "all", "--engine-dtypes", "bfloat16", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = {m["name"]: m for m in map(GEOMETRY.match, run.stdout.splitlines()) if m}
    assert set(lines) == {"qwen3_30b_router", "deepseek_v3_router"}, run.stdout
    assert "arXiv:2510.11370" in run.stdout  # R3's numbers printed beside ours
    result = json.loads((tmp_path / "result.json").read_text())
    for name, line in lines.items():
        assert float(line["on"]) == 0.0  # replay keeps every route at 128 / 256 experts
        g = result["geometries"][name]["bfloat16"]
        assert g["flip_rate_on"] == 0.0 and f"{g['flip_rate_off']:.4f}" == line["off"]
        assert result["geometries"][name]["margins"]["all"]["p50"] > 0  # margins shown
