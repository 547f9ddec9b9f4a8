"""Issue 30's true on-policy, single layout, fp32: rollouts from the embedded engine with
``--enable-deterministic-inference``, scored by megatron-core with
``trainer.numerics=batch_invariant`` (Keep Routing on), give the engine's logprob of
every trained token exactly: the full-vocabulary logprob, and the sampling-mask
(kept-set) logprob at temperature 0.7 and top-p 0.9 (the main job with both modes:
tests/e2e/test_true_on_policy_run.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moerl.checks.replay import collect_rollouts, score
from moerl.models.hf_tiny import save_tiny_checkpoint
from moerl.models.tiny import tiny_config

SAMPLING = {"temperature": 0.7, "top_p": 0.9, "top_k": -1}


@pytest.mark.parametrize(
    "family", ["qwen3_moe", pytest.param("deepseek_moe", marks=pytest.mark.slow)]
)
def test_trainer_logprobs_are_the_engines_bit_for_bit(tmp_path, family):
    hf = save_tiny_checkpoint(tiny_config(family), tmp_path / "hf", seed=0)
    trajs = collect_rollouts(
        hf, tmp_path / "r.jsonl", num_prompts=6, max_new_tokens=10, dtype="float32",
        sampling=SAMPLING, flags=("--enable-deterministic-inference",),
    )  # fmt: skip
    score("single", hf, tmp_path / "r.jsonl", tmp_path / "o.json",
          settings=[("on", "off"), ("on", "on")], numerics="batch_invariant")  # fmt: skip
    scored = json.loads((tmp_path / "o.json").read_text())["logprobs"]
    trained = np.concatenate([t.trained for t in trajs])
    assert trained.sum() >= 30
    engine = {
        "on/off": np.concatenate([t.response_logprobs for t in trajs])[trained],
        "on/on": np.concatenate([t.sampling_logprobs for t in trajs])[trained],
    }
    for key, want in engine.items():
        got = np.asarray(scored[key], dtype=np.float32)
        np.testing.assert_array_equal(got, want.astype(np.float32), err_msg=key)
    # the kept sets were real (top-p dropped ids), so the two differ somewhere
    assert not np.array_equal(engine["on/off"], engine["on/on"])
