"""Evaluation numbers: the unbiased pass@k against hand-computed values and the exact
binomial ratio, eval metrics from hand-built scored trajectories, and the eval config's
start-up checks."""

from __future__ import annotations

from fractions import Fraction
from math import comb
from typing import Any

import numpy as np
import pytest

from moerl.algo.pass_at_k import mean_pass_at_k, pass_at_k
from moerl.common.trajectory import Trajectory
from moerl.config.eval import EvalConfig
from moerl.config.task import ArithmeticTaskConfig, JsonlTaskConfig
from moerl.telemetry.eval_metrics import PromptResult, set_metrics

# n samples, c passing, k drawn: pass@k = 1 - C(n-c, k) / C(n, k), worked by hand
HAND = [
    (1, 0, 1, 0.0),
    (1, 1, 1, 1.0),
    (5, 0, 1, 0.0),  # c = 0: nothing ever passes
    (5, 0, 5, 0.0),
    (5, 5, 3, 1.0),  # c = n: everything passes
    (5, 1, 1, 0.2),  # pass@1 = c / n
    (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    (10, 3, 5, 1 - 21 / 252),  # 1 - C(7,5)/C(10,5)
    (4, 2, 3, 1.0),  # n - c = 2 < k = 3: every 3-subset holds a pass
    (4, 1, 4, 1.0),  # k = n: passes iff any sample passes
    (100, 1, 1, 0.01),
    (20, 4, 10, 1 - 8008 / 184756),  # 1 - C(16,10)/C(20,10)
]


@pytest.mark.parametrize(("n", "c", "k", "want"), HAND)
def test_pass_at_k_hand_values(n, c, k, want):
    assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12)


def exact(n: int, c: int, k: int) -> Fraction:
    """The definition, in exact rationals (a peer's formula, written out again)."""
    return 1 - Fraction(comb(n - c, k), comb(n, k))


def test_pass_at_k_matches_the_binomial_ratio_everywhere_small():
    for n in range(1, 16):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(float(exact(n, c, k)), abs=1e-12)


def test_pass_at_k_is_stable_where_the_binomials_overflow_floats():
    n, c, k = 2000, 17, 300  # C(2000, 300) ~ 1e371: a float ratio would be inf / inf
    with pytest.raises(OverflowError):
        float(comb(n, k))
    assert pass_at_k(n, c, k) == pytest.approx(float(exact(n, c, k)), rel=1e-12)
    # and a human-eval style vectorised product gives the same number
    peer = 1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1))
    assert pass_at_k(n, c, k) == pytest.approx(peer, rel=1e-12)


@pytest.mark.parametrize(("n", "c", "k"), [(3, 0, 4), (3, 1, 0), (3, 4, 1), (3, -1, 1)])
def test_pass_at_k_rejects_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="pass@k"):
        pass_at_k(n, c, k)


def test_mean_pass_at_k_averages_problems():
    assert mean_pass_at_k(4, [0, 2, 4], 2) == pytest.approx((0 + (1 - 1 / 6) + 1) / 3)
    assert mean_pass_at_k([2, 4], [1, 1], 1) == pytest.approx((0.5 + 0.25) / 2)
    with pytest.raises(ValueError, match="no problems"):
        mean_pass_at_k(4, [], 1)


def scored(reward: float, length: int) -> Trajectory:
    return Trajectory(
        prompt_ids=np.array([1, 2], np.int32),
        response_ids=np.full(length, 5, np.int32),
        response_logprobs=np.zeros(length, np.float32),
        versions=np.zeros(length, np.int32),
        finish_reason="stop",
        reward=reward,
    )


def test_set_metrics_from_hand_built_trajectories():
    results = [
        PromptResult(scored(1.0, 2), [scored(r, 1) for r in (1.0, 0.0, 0.0, 0.0)]),
        PromptResult(scored(0.0, 4), [scored(r, 1) for r in (0.0, 0.5, 0.0, 0.0)]),
        PromptResult(scored(1.0, 2), [scored(r, 3) for r in (1.0, 1.0, 1.0, 1.0)]),
    ]
    m = set_metrics("arith", results, ks=[1, 4], threshold=1.0)
    assert m["eval/arith/pass@1"] == pytest.approx(2 / 3)  # greedy
    assert m["eval/arith/pass@1_sampled"] == pytest.approx((0.25 + 0.0 + 1.0) / 3)
    assert m["eval/arith/pass@4"] == pytest.approx(2 / 3)
    assert m["eval/arith/reward_mean"] == pytest.approx((2.0 + 1.0 + 0.5 + 4.0) / 15)
    assert m["eval/arith/response_len_mean"] == pytest.approx((8 + 4 + 4 + 12) / 15)
    assert m["eval/arith/prompts"] == 3
    # a lower threshold counts partial credit as a pass
    assert set_metrics("a", results, [4], 0.5)["eval/a/pass@4"] == pytest.approx(1.0)


def test_set_metrics_without_greedy_reports_the_sampled_pass_at_1():
    results = [PromptResult(None, [scored(1.0, 1), scored(0.0, 1)])]
    m = set_metrics("s", results, ks=[1, 2], threshold=1.0)
    assert m["eval/s/pass@1"] == 0.5 and m["eval/s/pass@2"] == 1.0
    assert "eval/s/pass@1_sampled" not in m


def test_set_metrics_needs_rewards():
    unscored = scored(0.0, 1)
    unscored.reward = None
    with pytest.raises(ValueError, match="not scored"):
        set_metrics("s", [PromptResult(unscored)], [], 1.0)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"every": -1}, "eval.every"),
        ({"num_prompts": 0}, "eval.num_prompts"),
        ({"n": 2, "k": [1, 4]}, "raise eval.n"),
        ({"n": 4, "k": []}, "eval.k is empty"),
        ({"greedy": False, "n": 0}, "generate nothing"),
        ({"n": 4, "temperature": 0.0}, "eval.temperature"),
        ({"sets": {"a/b": {"name": "arithmetic"}}}, "set name"),
        ({"sets": {"x": {"seed": 3}}}, "task spec"),
    ],
)
def test_eval_config_rejects_out_of_range_options(options, match):
    with pytest.raises(ValueError, match=match):
        EvalConfig(**options).validate("eval")


def test_greedy_only_eval_needs_no_k():
    EvalConfig(every=1, greedy=True, n=0, k=[1, 4]).validate("eval")


def test_eval_sets_default_to_the_training_task_at_another_seed():
    task = ArithmeticTaskConfig(seed=0, max_operand=9)
    sets = EvalConfig(seed=77).resolve_sets(task)
    assert list(sets) == ["arithmetic"]
    assert sets["arithmetic"].seed == 77 and sets["arithmetic"].max_operand == 9
    named = EvalConfig(sets={"a": {"name": "copy_digits", "seed": 5}}).resolve_sets(task)
    assert named == {"a": {"name": "copy_digits", "seed": 5}}
    with pytest.raises(ValueError, match="held-out file"):
        EvalConfig().resolve_sets(JsonlTaskConfig(path="train.jsonl"))


def test_a_data_set_is_evaluated_on_its_eval_split():
    from moerl.config.task import DatasetTaskConfig

    task = DatasetTaskConfig(path="data/wp", split="train", eval_split="test", seed=3)
    (spec,) = EvalConfig(seed=77).resolve_sets(task).values()
    assert spec.split == "test" and not spec.shuffle


def _compose(*overrides: str) -> Any:
    from hydra import compose, initialize_config_module

    from moerl.config.store import register_configs

    register_configs()
    with initialize_config_module(config_module="moerl.conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_eval_group_composes_and_validates_at_start_up():
    from moerl.validate import validate_config

    off = validate_config(_compose("+recipe=deepseek_moe"), world_size=1)
    assert off.eval.every == 0 and not off.eval.enabled
    on = validate_config(
        _compose("+recipe=deepseek_moe", "eval=default",
                 "+eval.sets.arith={name:arithmetic,seed:7,max_operand:50}"),
        world_size=1,
    )  # fmt: skip
    assert on.eval.every == 10 and on.eval.sets["arith"]["max_operand"] == 50
    with pytest.raises(ValueError, match=r"eval\.sets\.arith: .*max_operandd"):
        validate_config(
            _compose("eval=default", "+eval.sets.arith={name:arithmetic,max_operandd:5}"),
            world_size=1,
        )
    with pytest.raises(ValueError, match=r"eval\.sets\.bad: .*min_operand"):
        validate_config(
            _compose("eval=default", "+eval.sets.bad={name:arithmetic,min_operand:-1}"),
            world_size=1,
        )
    with pytest.raises(ValueError, match="eval.k"):
        validate_config(_compose("eval=default", "eval.n=2"), world_size=1)
    with pytest.raises(ValueError, match="not episodes"):
        validate_config(_compose("+recipe=calculator", "eval=default"), world_size=1)
