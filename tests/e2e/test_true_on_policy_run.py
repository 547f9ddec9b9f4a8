"""Issue 30: the main job with the engine's batch-invariant mode and the trainer's
matching numerics, synchronous: the IS ratio is exactly 1 and the train/inference
mismatch exactly 0 on every step, the steps after a weight push too."""

from __future__ import annotations

import pytest
from test_run import _launch

from moerl.telemetry.metrics import read_metrics


@pytest.mark.slow  # the main job, 3 steps (~40 s)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_main_job_is_exactly_on_policy(tmp_path, dtype):
    """In bf16 the run pushes the trainer's weights before the first step (transformers
    keeps DeepSeek's router weight in fp32: from the checkpoint it is not the trainer's)."""
    run = tmp_path / "exact"
    engine = {"fp32": "float32", "bf16": "bfloat16"}[dtype]
    _launch(run, "trainer.train_iters=3", "staleness=sync", "engine.deterministic_inference=true",
            "trainer.numerics=batch_invariant", "eval.every=0", f"trainer.dtype={dtype}",
            f"engine.dtype={engine}")  # fmt: skip
    m = read_metrics(run)
    assert [r["step"] for r in m] == [0, 1, 2]
    for r in m:  # every step, the ones after a weight push too
        assert r["mismatch/log_ratio_abs_max"] == 0.0, r["step"]
        assert r["mismatch/abs_diff_max"] == 0.0, r["step"]
        assert r["loss/ratio_max"] == 1.0 and r["loss/ratio_mean"] == 1.0
    assert m[0]["mismatch/numerics"] == 0.0  # the decomposition's numerics term
