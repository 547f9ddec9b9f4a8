"""tools/bench/engine.py runs end to end (smallest settings), so it cannot rot.
Speed targets are printed by the benchmark, never asserted here."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_engine_benchmark_quick():
    spec = importlib.util.spec_from_file_location(
        "bench_engine", ROOT / "tools" / "bench" / "engine.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)  # type: ignore[union-attr]
    results = bench.main(["--quick", "--threads", "1", "--generate-shape", "tiny"])
    keys = ("tokens_per_s_c1", "tokens_per_s_c32", "batching_speedup", "stall_decode_steps")
    for key in (*keys, "turn_prefix_reuse_speedup", "turn_cached_tokens_median"):
        assert results[key] > 0
    for key in ("fixed_ratio", "longtail_ratio", "fixed_hf_tok_s", "longtail_engine_tok_s"):
        assert results[key] > 0
    # a group of 8 samples of one prompt prefills it once
    assert results["group_prefill_tokens"] == results["group_prompt_tokens"]
    # the group of 8 on a 512-token prompt holds its prompt once (memory, not speed)
    assert results["shared_prompt_kv_ratio"] <= 1.3 < results["copied_prompt_kv_ratio"]
