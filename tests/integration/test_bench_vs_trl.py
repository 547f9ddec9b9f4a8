"""tools/bench/vs_trl.py runs end to end (3 steps per run), so it cannot rot. It needs TRL
(the `bench` extra, never installed by CI): without it the test skips, and the bench
itself says why and records that it was skipped. The targets are printed by the bench,
never asserted here."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KEYS = ("trl_s_step", "moerl_sync_s_step", "moerl_async_s_step", "ratio_sync", "ratio_async",
        "startup_ratio", "memory_ratio")  # fmt: skip


def _bench(name: str = "vs_trl"):  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(
        f"bench_{name}", ROOT / "tools" / "bench" / f"{name}.py"
    )
    bench = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[spec.name] = bench  # type: ignore[union-attr]  # dataclasses look it up
    spec.loader.exec_module(bench)  # type: ignore[union-attr]
    return bench


def test_without_trl_the_bench_says_so_and_records_the_skip(tmp_path, capsys, monkeypatch):
    bench = _bench()
    monkeypatch.setattr(bench, "trl_missing", lambda: bench.MISSING)
    result = bench.main(["--quick", "--out", str(tmp_path)])
    assert result == {"skipped": bench.MISSING}
    assert "vs_trl skipped: TRL is not installed" in capsys.readouterr().out
    assert json.loads((tmp_path / "result.json").read_text()) == result
    # the results page says why instead of failing the bench
    results = {"benches": {"vs_trl": {"status": "ok", "result": result}}}
    (row,) = [r for r in _bench("report").headlines(results) if r.bench == "vs_trl"]
    assert row.ours == "n/a (TRL is not installed)" and row.status == "n/a"


@pytest.mark.slow  # three runs of the main job, 3 steps each (~60 s on 2 cores)
def test_vs_trl_benchmark_quick(tmp_path, capsys):
    pytest.importorskip("trl", reason="TRL is the `bench` extra: pip install -e '.[bench]'")
    result = _bench().main(["--quick", "--out", str(tmp_path)])
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("vs_trl trl_s_step=")]
    assert len(lines) == 1
    fields = dict(re.findall(r"(\w+)=([\d.]+)", lines[0]))
    assert list(fields)[: len(KEYS)] == list(KEYS)
    for key in KEYS:
        assert float(fields[key]) > 0, key
    for name in ("trl", "moerl_sync", "moerl_async"):
        run = result[name]["runs"][0]
        assert run["steps"] == 3 and len(run["reward"]) == 3, name
        assert 0 < run["startup_s"] < run["first_step_s"], name
        assert run["peak_rss_mb"] > 100 and run["peak_procs"] >= 1, name
    assert result["moerl_sync"]["runs"][0]["peak_procs"] >= 2  # the launcher's ranks, engine
    assert result["moerl_sync"]["staleness_max"] == 0  # the sync runs really were synchronous
    saved = json.loads((tmp_path / "result.json").read_text())
    assert saved["ratio_sync"] == pytest.approx(result["ratio_sync"])
