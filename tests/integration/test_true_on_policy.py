"""Issue 30's true on-policy, fp32: rollouts from the embedded engine with
``--enable-deterministic-inference``, scored by megatron-core with
``trainer.numerics=batch_invariant`` (Keep Routing on), give the engine's logprob of
every trained token exactly: the full-vocabulary logprob, and the sampling-mask
(kept-set) logprob at temperature 0.7 and top-p 0.9; in the single layout and with
tensor, expert-tensor, pipeline, expert and data parallelism; in fp32 and bf16 (the main
job with both modes: tests/e2e/test_true_on_policy_run.py).

The bf16 checkpoints hold bf16 values: transformers keeps DeepSeek's router weight in
fp32, so an fp32 checkpoint's router would not be the trainer's bf16 one (the main job
pushes the trainer's weights to the engines before its first step for that reason)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from moerl.checks.replay import collect_rollouts, score
from moerl.models.hf_tiny import save_tiny_checkpoint
from moerl.models.tiny import tiny_config

SAMPLING = {"temperature": 0.7, "top_p": 0.9, "top_k": -1}
slow = pytest.mark.slow  # multi-rank scoring: out of the default run (20-minute budget)


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory) -> dict:
    """family → (checkpoint, rollout file, trajectories): 8 prompts, so a data-parallel
    size of 4 splits them."""
    made: dict = {}

    def get(family: str, dtype: str) -> tuple[Path, Path, list]:
        if (family, dtype) not in made:
            tmp = tmp_path_factory.mktemp(f"{family}-{dtype}")
            hf = save_tiny_checkpoint(
                tiny_config(family), tmp / "hf", seed=0, bf16_values=dtype == "bfloat16"
            )
            trajs = collect_rollouts(
                hf, tmp / "r.jsonl", num_prompts=8, max_new_tokens=8, dtype=dtype,
                sampling=SAMPLING, flags=("--enable-deterministic-inference",),
            )  # fmt: skip
            made[family, dtype] = (hf, tmp / "r.jsonl", trajs)
        return made[family, dtype]  # type: ignore[no-any-return]

    return get  # type: ignore[return-value]


@pytest.mark.parametrize(
    "family, layout, dtype",
    [
        ("qwen3_moe", "single", "float32"),
        pytest.param("deepseek_moe", "single", "bfloat16", marks=slow),
        pytest.param("qwen3_moe", "tp2", "bfloat16", marks=slow),
        pytest.param("deepseek_moe", "dp2ep2", "bfloat16", marks=slow),
        pytest.param("qwen3_moe", "etp2ep2", "bfloat16", marks=slow),
        pytest.param("deepseek_moe", "tp2ep2", "bfloat16", marks=slow),
        pytest.param("qwen3_moe", "pp2", "bfloat16", marks=slow),
        pytest.param("deepseek_moe", "ep2", "bfloat16", marks=slow),
        pytest.param("deepseek_moe", "single", "float32", marks=slow),
        pytest.param("qwen3_moe", "pp2", "float32", marks=slow),
        pytest.param("deepseek_moe", "pp2", "float32", marks=slow),
        pytest.param("qwen3_moe", "ep2", "float32", marks=slow),
        pytest.param("deepseek_moe", "dp2ep2", "float32", marks=slow),
        pytest.param("qwen3_moe", "tp2", "float32", marks=slow),
        pytest.param("qwen3_moe", "tp2ep2", "float32", marks=slow),
        pytest.param("deepseek_moe", "etp2ep2", "float32", marks=slow),
        pytest.param("deepseek_moe", "tp2", "float32", marks=slow),
    ],
)
def test_trainer_logprobs_are_the_engines_bit_for_bit(rollouts, tmp_path, family, layout, dtype):
    hf, path, trajs = rollouts(family, dtype)
    score(layout, hf, path, tmp_path / "o.json", settings=[("on", "off"), ("on", "on")],
          numerics="batch_invariant", dtype="bf16" if dtype == "bfloat16" else "fp32")  # fmt: skip
    scored = json.loads((tmp_path / "o.json").read_text())["logprobs"]
    trained = np.concatenate([t.trained for t in trajs])
    assert trained.sum() >= 40
    engine = {
        "on/off": np.concatenate([t.response_logprobs for t in trajs])[trained],
        "on/on": np.concatenate([t.sampling_logprobs for t in trajs])[trained],
    }
    for key, want in engine.items():
        got = np.asarray(scored[key], dtype=np.float32)
        np.testing.assert_array_equal(got, want.astype(np.float32), err_msg=key)
    # the kept sets were real (top-p dropped ids), so the two differ somewhere
    assert not np.array_equal(engine["on/off"], engine["on/on"])


@slow
def test_episodes_across_turns_are_exact(tmp_path):
    """3-turn episodes whose later turns re-send (or reuse from the prefix cache) the
    earlier ones, with spliced observation tokens: every trained token still matches."""
    from moerl.checks.replay import collect_episodes

    hf = save_tiny_checkpoint(tiny_config("deepseek_moe"), tmp_path / "hf", seed=0)
    path = tmp_path / "e.jsonl"
    trajs = collect_episodes(
        hf, path, num_episodes=4, turns=3, flags=("--enable-deterministic-inference",)
    )
    score("single", hf, path, tmp_path / "o.json", settings=[("on", "on")],
          numerics="batch_invariant")  # fmt: skip
    got = np.asarray(json.loads((tmp_path / "o.json").read_text())["logprobs"]["on/on"])
    trained = np.concatenate([t.trained for t in trajs])
    assert not trained.all()  # observation tokens are not trained
    want = np.concatenate([t.sampling_logprobs for t in trajs])[trained]
    np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))
