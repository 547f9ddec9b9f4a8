"""tools/bench/scaling.py: the exponent fit recovers known slopes, the arithmetic cost
model grows as its FLOP counts say, and the smallest run of the bench prints one line per
cost curve and writes its plots (a child process: it makes its own one-rank gloo world)."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "tools" / "bench"
LINE = re.compile(
    r"^scaling curve=(?P<sweep>\w+)/(?P<metric>\w+) x=\w+ metric=(?P=metric) "
    r"exponent=(?P<exp>-?[\d.]+|nan) arithmetic=(?P<arith>-?[\d.]+|nan) "
    r"verdict=(?P<verdict>ok|above|n/a)$"
)


def _model():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("test_scaling_model", BENCH / "scaling_model.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[spec.name] = module  # type: ignore[union-attr]  # dataclasses look it up
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


@pytest.mark.parametrize("slope", [-1.0, 0.5, 1.0, 2.0])
def test_exponent_recovers_a_power_law(slope):
    sm = _model()
    xs = [256.0, 512.0, 1024.0, 2048.0, 4096.0]
    noise = [1.02, 0.97, 1.01, 0.99, 1.03]  # a few percent, as timing noise
    ys = [3.0 * x**slope * n for x, n in zip(xs, noise)]
    assert sm.exponent(xs, ys) == pytest.approx(slope, abs=0.02)


def test_exponent_of_a_quadratic_plus_linear_cost_lies_between():
    sm = _model()
    xs = [256.0, 1024.0, 4096.0]
    assert 1.0 < sm.exponent(xs, [x + x * x / 1024 for x in xs]) < 2.0
    assert math.isnan(sm.exponent([1.0], [1.0])) and math.isnan(sm.exponent([1.0, 2.0], [0.0, 1.0]))


def test_verdict_reads_costs_and_rates_the_right_way_round():
    sm = _model()
    assert sm.verdict(2.0, 1.0) == "above" and sm.verdict(1.1, 1.0) == "ok"
    assert sm.verdict(0.5, 1.0) == "ok"  # slower growth than the arithmetic is fine
    assert sm.verdict(-1.5, -1.0, sign=-1) == "above"  # tokens/s falling faster than it should
    assert sm.verdict(-0.5, -1.0, sign=-1) == "ok"
    assert sm.verdict(math.nan, 1.0) == "n/a"


def test_arithmetic_grows_as_the_flop_counts_say():
    sm = _model()
    rates = {"flops_per_s": 1e9, "bytes_per_s": 1e30}  # FLOPs only
    shape = sm.Shape(hidden=128, experts=8, topk=2)
    # long sequences: attention's S^2 dominates the trainer step and the prefill
    step = [sm.roofline(*sm.train_step(shape, s, 2), rates) for s in (8192, 16384, 32768)]
    assert sm.exponent([8192, 16384, 32768], step) == pytest.approx(2.0, abs=0.1)
    # more experts at fixed top-k: the same active FLOPs (only the router grows)
    per_e = [sm.roofline(*sm.train_step(sm.Shape(256, e, 2), 256, 4), rates) for e in (4, 64)]
    assert sm.exponent([4, 64], per_e) < 0.1
    # bytes: weights scale with experts at large E
    big = [sm.sync_bytes(sm.Shape(256, e, 2)) for e in (64, 128, 256)]
    assert sm.exponent([64, 128, 256], big) == pytest.approx(1.0, abs=0.05)
    weights = sum(p.numel() for p in _megatron_free_count(shape))
    assert shape.params() == weights


def _megatron_free_count(shape):  # type: ignore[no-untyped-def]
    """The parameters of the HF model the bench builds for ``shape`` (transformers only)."""
    import dataclasses

    from moerl.models.hf_tiny import build_hf_model
    from moerl.models.tiny import tiny_config

    cfg = dataclasses.replace(
        tiny_config("qwen3_moe"), num_layers=shape.layers, first_k_dense_replace=0,
        hidden_size=shape.hidden, num_attention_heads=shape.heads,
        num_query_groups=shape.groups, kv_channels=shape.head_dim, vocab_size=shape.vocab,
        num_experts=shape.experts, moe_router_topk=shape.topk,
        moe_ffn_hidden_size=shape.expert_ffn,
    )  # fmt: skip
    return list(build_hf_model(cfg).parameters())


@pytest.mark.slow  # ~45 s: three engines and trainers
def test_scaling_smoke_prints_every_curve(tmp_path):
    run = subprocess.run(
        [sys.executable, str(BENCH / "scaling.py"), "--smoke", "--sweeps", "hidden", "seq",
         "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = [m for m in map(LINE.match, run.stdout.splitlines()) if m is not None]
    got = {(m["sweep"], m["metric"]) for m in lines}
    metrics = ("step_s", "peak_mb", "ttft_s", "decode_tok_s")
    assert got == {("hidden", m) for m in (*metrics, "sync_s")} | {("seq", m) for m in metrics}
    result = json.loads((tmp_path / "result.json").read_text())
    for curve in result["curves"]:
        assert all(y > 0 for y in curve["y"]) and len(curve["x"]) == 2
    for sweep in ("hidden", "seq"):
        png = tmp_path / f"scaling_{sweep}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
