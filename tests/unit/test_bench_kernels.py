"""tools/bench/kernel_speed.py runs end to end on CPU (tiny sizes), so it cannot rot. On CPU
only the torch side is timed; the kernel columns read nan. Speed and memory targets are
printed by the benchmark on a GPU, never asserted here."""

from __future__ import annotations

import importlib.util
import json
import math
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NUMBER = r"(?:[\d.]+|nan|oom)"
LINE = re.compile(
    rf"^kernel=(?P<kernel>\w+) size=(?P<size>\S+) kernel_ms=(?P<kernel_ms>{NUMBER}) "
    rf"torch_ms=(?P<torch_ms>{NUMBER}) speedup=(?P<speedup>{NUMBER}) "
    rf"kernel_peak_mb=(?P<kernel_peak_mb>{NUMBER}) torch_peak_mb=(?P<torch_peak_mb>{NUMBER}) "
    rf"mem_ratio=(?P<mem_ratio>{NUMBER})$"
)


def _bench():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(
        "bench_kernels", ROOT / "tools/bench/kernel_speed.py"
    )
    bench = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(bench)  # type: ignore[union-attr]
    return bench


def test_kernels_benchmark_quick_cpu(tmp_path, capsys):
    rows = _bench().main(["--quick", "--device", "cpu", "--out", str(tmp_path)])
    printed = [m.groupdict() for m in map(LINE.match, capsys.readouterr().out.splitlines()) if m]
    assert len(printed) == len(rows)
    names = [r["kernel"] for r in rows]
    assert {"fused_logprobs", "logprobs_from_logits"} <= set(names)
    for row, line in zip(rows, printed):
        assert line["kernel"] == row["kernel"] and line["size"] == row["size"]
        assert row["torch_ms"] > 0 and float(line["torch_ms"]) >= 0
        assert math.isnan(row["kernel_ms"]) and line["kernel_ms"] == "nan"  # n/a on CPU
        assert line["mem_ratio"] == "nan"
    saved = json.loads((tmp_path / "result.json").read_text())
    assert saved["device"] == "cpu"
    assert [r["kernel"] for r in saved["rows"]] == names
    assert all(r["kernel_ms"] is None and r["torch_ms"] > 0 for r in saved["rows"])


def test_logprob_chunk_sweep_dry_run(capsys):
    """tools/bench/logprob_chunks.py (a GPU tool) runs its code on the CPU interpreter: one
    line for the torch path and one per chunk shape, each with both timings."""
    spec = importlib.util.spec_from_file_location(
        "bench_logprob_chunks", ROOT / "tools/bench/logprob_chunks.py"
    )
    bench = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(bench)  # type: ignore[union-attr]
    rows = bench.main(["--dry-run"])
    assert [(r["path"], r["chunks"]) for r in rows] == [
        ("torch", "-"), ("fused", "8x64"), ("fused", "16x32")
    ]  # fmt: skip
    assert all(r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 for r in rows)
    out = capsys.readouterr().out
    assert out.count("path=fused chunks=") == 2 and "fwd_bwd_ms=" in out
