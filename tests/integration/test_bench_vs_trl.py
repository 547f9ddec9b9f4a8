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
    # where a step goes: TRL's own calls, moerl's trainer spans, each a steady step's median
    assert set(result["trl"]["parts_ms"]) == {"generate", "loss_forward", "backward", "optimizer"}
    for name in ("moerl_sync", "moerl_async"):
        assert set(result[name]["parts_ms"]) == {"wait", "train", "sync"}, name
    for name in ("trl", "moerl_sync", "moerl_async"):
        parts = result[name]["parts_ms"]
        assert all(v > 0 for v in parts.values()), (name, parts)
        assert sum(parts.values()) <= 1e3 * result[name]["s_step"] * 1.5, (name, parts)
    saved = json.loads((tmp_path / "result.json").read_text())
    assert saved["ratio_sync"] == pytest.approx(result["ratio_sync"])


def test_placements_run_side_by_side_with_their_own_override(tmp_path):
    """--placements recipe,colocated: the same sync and async runs again with
    launcher.placement=colocated (the recipe's runs set none), and the results page
    carries a row per extra ratio against its target."""
    bench = _bench()
    names = bench.run_names(["recipe", "colocated"])
    assert names == ("trl", "moerl_sync", "moerl_async", "moerl_sync_colocated",
                     "moerl_async_colocated")  # fmt: skip
    cmds = {n: bench.command(n, tmp_path, 5, tmp_path / n, None,
                             bench.placement_of(n, ["recipe", "colocated"]))
            for n in names[1:]}  # fmt: skip
    assert "staleness=sync" in cmds["moerl_sync_colocated"]
    assert "staleness=sync" not in cmds["moerl_async_colocated"]
    assert all("launcher.placement=colocated" in cmds[n] for n in names[3:])
    assert not any(a.startswith("launcher.placement") for n in names[1:3] for a in cmds[n])
    # the recipe's placement as the extra one: its runs set none either
    assert bench.placement_of("moerl_sync_recipe", ["colocated", "recipe"]) is None
    assert bench.placement_of("moerl_sync", ["colocated", "recipe"]) == "colocated"
    ratios = {"ratio_sync": 2.0, "ratio_async": 1.5, "startup_ratio": 1.2, "memory_ratio": 1.3}
    result = {"placements": ["recipe", "colocated"], "placement_colocated": ratios,
              "targets": bench.TARGETS, "trl": {}, "steps": 5, "repeats": 1}  # fmt: skip
    results = {"benches": {"vs_trl": {"status": "ok", "result": result}}}
    rows = [r for r in _bench("report").headlines(results) if "placement=colocated" in r.metric]
    assert [(r.ours, r.status) for r in rows] == [
        ("2.00×", "not met"),
        ("1.50×", "not met"),
        ("1.20×", "met"),
        ("1.30×", "met"),
    ]


def test_each_repetition_is_compared_with_the_trl_run_beside_it():
    """The per-repeat ratios pair the i-th moerl run with the i-th TRL run (adjacent in
    the rotation), skip a run without a step time, and the results page shows their
    spread beside the ratio of medians."""
    bench = _bench()
    trl = [{"s_step": 0.10}, {"s_step": 0.20}, {"s_step": None}]
    sync = [{"s_step": 0.12}, {"s_step": 0.20}, {"s_step": 0.5}]
    assert bench.paired_ratios(sync, trl) == pytest.approx([1.2, 1.0])
    result = {"ratio_sync": 1.1, "ratio_sync_per_repeat": [1.2, 1.0], "ratio_async": 0.7,
              "ratio_async_per_repeat": [0.7], "targets": bench.TARGETS, "trl": {},
              "steps": 5, "repeats": 2}  # fmt: skip
    results = {"benches": {"vs_trl": {"status": "ok", "result": result}}}
    rows = {r.metric: r.ours for r in _bench("report").headlines(results) if "s/step" in r.metric}
    assert rows["s/step, moerl sync / TRL"].endswith("; per repeat 1.00–1.20×)")
    assert "per repeat" not in rows["s/step, moerl async (recipe as shipped) / TRL"]
