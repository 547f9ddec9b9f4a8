"""tools/bench/true_on_policy.py runs end to end (smallest settings), so it cannot rot.
The overhead targets are printed by the benchmark, never asserted here."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # two tiny and two mid engines in this process, two scorings (~40 s)
def test_true_on_policy_benchmark_smallest(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location(
        "bench_true_on_policy", ROOT / "tools" / "bench" / "true_on_policy.py"
    )
    bench = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(bench)  # type: ignore[union-attr]
    result = bench.main(["--quick", "--reps", "1", "--new-tokens", "6", "--out", str(tmp_path)])
    out = capsys.readouterr().out.splitlines()
    line = [x for x in out if x.startswith("true_on_policy ")]
    assert len(line) == 1
    fields = dict(re.findall(r"(\w+)=(\S+)", line[0]))
    assert fields["engine_invariant"] == "6/6"  # the mode holds every scenario
    assert float(fields["engine_overhead"]) > 0 and float(fields["engine_overhead_mid"]) > 0
    assert fields["layouts_exact"] == "1/7"  # the single layout; the others not built
    assert float(fields["abs_diff_max"]) == 0.0 < float(fields["abs_diff_max_off"])
    assert re.search(
        r"^deepseek_moe/float32 invariant_off=\d/6 invariant_on=6/6 ", "\n".join(out), re.M
    )
    saved = json.loads((tmp_path / "result.json").read_text())
    assert saved["engine_overhead"] == result["engine_overhead"]
