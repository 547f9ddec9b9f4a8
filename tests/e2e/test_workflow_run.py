"""The real-data recipe end to end (`+recipe=word_problems`): parquet word problems
through HF datasets and the chat template, the math verifier, a tiny PRM on its own
embedded engine, per-step credit and evaluation beside training."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from test_run import _launch

from moerl.telemetry.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_word_problems_recipe_runs_with_prm_and_eval(tmp_path):
    data = tmp_path / "data" / "word_problems"
    subprocess.run(
        [sys.executable, str(ROOT / "tools" / "make_word_problems.py"), "--out", str(data)],
        check=True, timeout=120,
    )  # fmt: skip
    run = tmp_path / "wp"
    _launch(run, "trainer.train_iters=3", "trainer.lr_warmup_steps=0", "eval.every=2",
            "eval.num_prompts=8", f"task.path={data}", recipe="word_problems")  # fmt: skip
    m = read_metrics(run)
    assert [r["step"] for r in m] == [0, 1, 2]
    assert all(r["reward_model/scored"] > 0 and r["reward_model/failures"] == 0 for r in m)
    evals = [r for r in m if "eval/dataset/pass@1" in r]
    assert evals and evals[0]["eval/dataset/prompts"] == 8
    assert 0.0 <= evals[0]["eval/dataset/pass@4"] <= 1.0
