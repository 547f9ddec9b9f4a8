"""The episode recipes end to end: `python -m moerl.launch +recipe=NAME` with a real
embedded engine, real trainer and weight sync, on the CPU."""

from __future__ import annotations

import pytest
from test_run import _launch

from moerl.telemetry.metrics import read_metrics


@pytest.mark.slow  # ~30 s; the guess_number run keeps a recipe's episodes in the default set
def test_two_agent_recipe_trains_both_roles(tmp_path):
    """Two steps of the proposer/solver recipe: each group's episodes give one trajectory
    per role, both roles' rewards are reported, and the step trains on them."""
    run = tmp_path / "two_agent"
    _launch(run, "trainer.train_iters=2", "trainer.lr_warmup_steps=0",
            "trainer.global_batch_size=16", "telemetry.flip_every=0", recipe="two_agent")  # fmt: skip
    m = read_metrics(run)
    assert [r["step"] for r in m] == [0, 1]
    for r in m:
        assert "episode/reward_proposer" in r and "episode/reward_solver" in r
        assert r["episode/turns_mean"] == 2.0  # the proposer's turn and the solver's


@pytest.mark.slow  # out of the default run (the suite's 20-minute budget)
def test_guess_number_recipe_plays_several_turns(tmp_path):
    run = tmp_path / "guess"
    _launch(run, "trainer.train_iters=2", "trainer.lr_warmup_steps=0",
            "trainer.global_batch_size=16", "telemetry.flip_every=0", recipe="guess_number")  # fmt: skip
    m = read_metrics(run)
    assert [r["step"] for r in m] == [0, 1]
    # the rollout side reports the episodes finished since the last step: with a fast
    # step the second batch may come entirely from groups finished before the first
    played = [r for r in m if "episode/turns_mean" in r]
    assert played and played[0]["step"] == 0
    # step 0's report holds the first batch's episodes; a later one may hold a handful
    # (once groups are one request each, a few 1-turn episodes can make a whole report)
    first = played[0]
    assert first["episode/turns_mean"] > 1.0 and first["episode/tool_calls"] > 0
    assert sum(r["episode/tool_calls"] for r in played) >= first["episode/tool_calls"]


@pytest.mark.slow
def test_calculator_recipe_reward_rises(tmp_path):
    """30 steps of the tool-use recipe on the tiny random-init model (about 2 CPU
    minutes): the reward of the last ten steps beats the first five's."""
    run = tmp_path / "calculator"
    _launch(run, "telemetry.flip_every=0", recipe="calculator", timeout=900)
    rewards = [r["reward_mean"] for r in read_metrics(run)]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-10:]) / 10
    assert last > first + 0.03, f"reward did not rise: {first:.3f} -> {last:.3f} ({rewards})"
