"""Evaluation end to end on the CPU: `python -m moerl.launch +recipe=deepseek_moe
eval.every=2` evaluates held-out prompts in the background while training goes on, and
`python -m moerl.eval` evaluates the run's checkpoint offline with the same numbers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moerl.telemetry.metrics import read_metrics
from moerl.telemetry.timeline import load_timeline

QUIET = ["telemetry.progress_interval_s=1000"]
SMALL_EVAL = ["eval=default", "eval.num_prompts=6", "eval.n=2", "eval.k=[1,2]"]
SET = "eval/copy_digits"  # no eval.sets: the training task at eval.seed


def _run(module: str, run_dir: Path, *overrides: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", module, "+recipe=deepseek_moe", *QUIET,
         f"hydra.run.dir={run_dir}", *overrides],
        cwd=run_dir.parent, capture_output=True, text=True, timeout=900,
        env={**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout


@pytest.mark.slow  # out of the default run (the suite's 20-minute budget)
def test_eval_runs_beside_training_and_offline(tmp_path):
    run = tmp_path / "run"
    _run("moerl.launch", run, "trainer.train_iters=4", "eval.every=2", *SMALL_EVAL)
    m = read_metrics(run)
    assert [r["step"] for r in m] == [0, 1, 2, 3]
    # every finished eval has a line in eval.jsonl: launched after steps 1 and 3 on the
    # pushed policies (versions 2 and 4)
    lines = (run / "eval.jsonl").read_text().splitlines()
    evals = [json.loads(line) for line in lines]
    assert [(r[f"{SET}/step"], r[f"{SET}/version"]) for r in evals] == [(1.0, 2.0), (3.0, 4.0)]
    # metrics.jsonl carries each eval's numbers on the line of the step it finished in
    # (the newer one when two finish between two lines); the last step waited for its own
    logged = [r for r in m if f"{SET}/pass@1" in r]
    assert logged[-1]["step"] == 3 and logged[-1][f"{SET}/version"] == 4.0
    assert all(r[f"{SET}/pass@1"] == evals[int(r[f"{SET}/version"]) // 2 - 1][f"{SET}/pass@1"]
               for r in logged)  # fmt: skip
    for r in evals:
        assert 0.0 <= r[f"{SET}/pass@1"] <= 1.0 and 0.0 <= r[f"{SET}/pass@2"] <= 1.0
        assert r[f"{SET}/pass@1_sampled"] <= r[f"{SET}/pass@2"]
        assert r[f"{SET}/prompts"] == 6 and r[f"{SET}/response_len_mean"] > 0
    assert m[-1]["eval/launched_total"] == 2 and m[-1]["eval/errors_total"] == 0
    spans = [s for s in load_timeline(run) if s["kind"] == "eval"]
    assert [(s["step"], s["version"]) for s in spans] == [(1, 2), (3, 4)]
    # training went on during the first eval: a trainer step started before it ended
    trainer = [s for s in load_timeline(run) if s["process"] == "trainer"]
    assert any(s["step"] == 2 and s["start"] < spans[0]["end"] for s in trainer)

    out = tmp_path / "offline"
    printed = _run("moerl.eval", out, f"model.path={run / 'init_hf'}", *SMALL_EVAL)
    report = json.loads(printed[printed.index("{\n") :])  # the JSON ends the output
    assert report == json.loads((out / "eval.json").read_text())
    numbers = report["metrics"]
    assert numbers[f"{SET}/prompts"] == 6 and 0.0 <= numbers[f"{SET}/pass@2"] <= 1.0
    for key in ("pass@1", "pass@1_sampled", "pass@2", "reward_mean", "response_len_mean"):
        assert f"{SET}/{key}" in numbers
