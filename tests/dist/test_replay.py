"""Keep Routing and sampling-mask replay on rollouts from the embedded engine.

Rollouts come from a real engine serving the same tiny HF checkpoint the trainer loads,
never from hand-written routes.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from moerl.checks.replay import collect_episodes, collect_rollouts, score

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def fp32_rollouts(tiny_checkpoints, tmp_path_factory):
    path = tmp_path_factory.mktemp("rollouts") / "fp32.jsonl"
    collect_rollouts(
        tiny_checkpoints["deepseek_moe"], path, num_prompts=8, max_new_tokens=16, dtype="float32"
    )
    return tiny_checkpoints["deepseek_moe"], path


@pytest.mark.parametrize(
    "layout", ["single", "tp2ep2", pytest.param("pp2", marks=pytest.mark.slow)]
)
def test_on_policy_is_ratio_is_one_with_replay_and_mask(layout, fp32_rollouts, tmp_path):
    """Fresh rollouts, same weights, fp32: the trainer's logprob of every sampled token
    over the kept set equals the engine's, |log ratio| < 1e-5, and replay flips nothing."""
    hf, rollouts = fp32_rollouts
    results = {(r.replay, r.mask): r for r in score(layout, hf, rollouts, tmp_path / "s.json")}
    both = results[("on", "on")]
    assert both.max_abs_log_ratio < 1e-5, both
    assert both.flip_rate == 0.0 and all(x == 0.0 for x in both.flip_rate_per_layer)
    assert results[("on", "off")].max_abs_log_ratio < 1e-5


@pytest.fixture(scope="module")
def fp32_episodes(tiny_checkpoints, tmp_path_factory):
    path = tmp_path_factory.mktemp("episodes") / "fp32.jsonl"
    trajs = collect_episodes(tiny_checkpoints["deepseek_moe"], path, num_episodes=6, turns=3)
    return tiny_checkpoints["deepseek_moe"], path, trajs


@pytest.mark.parametrize("layout", ["single", pytest.param("tp2ep2", marks=pytest.mark.slow)])
def test_episode_is_ratio_is_one_across_turns(layout, fp32_episodes, tmp_path):
    """Fresh fp32 multi-turn episodes (observation tokens spliced between the actions,
    every later request re-sending the earlier turns, whose KV and routes the engine
    reuses from its prefix cache): with Keep Routing and the mask,
    every trained token's log ratio is < 1e-5 and replay flips no route, so the routes of
    spliced tokens (from the prefill of the request after them) and of earlier turns'
    tokens are the ones the engine used."""
    hf, rollouts, trajs = fp32_episodes
    assert all(t.num_trained < t.response_len for t in trajs)  # observations were spliced
    assert all(sum(s.source == "policy" for s in t.segments) >= 2 for t in trajs)
    # later turns reused the earlier turns' KV (and their routes) from the prefix cache
    assert all(t.meta["episode"]["cached_tokens"] > 0 for t in trajs)
    settings = [("on", "on"), ("on", "off")]
    results = {
        (r.replay, r.mask): r
        for r in score(layout, hf, rollouts, tmp_path / "s.json", settings=settings)
    }
    both = results[("on", "on")]
    assert both.max_abs_log_ratio < 1e-5, both
    assert both.flip_rate == 0.0
    assert results[("on", "off")].max_abs_log_ratio < 1e-5


@pytest.mark.slow  # out of the default run (the suite's 20-minute budget)
def test_check_replay_cli_bf16():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "check_replay.py"), "--family", "deepseek_moe",
         "--dtype", "bfloat16", "--prompts", "6", "--new-tokens", "12"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [x for x in proc.stdout.splitlines() if x.startswith("replay=")]
    assert len(lines) == 4 and all("flip_rate=" in x and "mismatch_k3=" in x for x in lines)
    assert any(x.startswith("replay=on mask=on flip_rate=0.0000") for x in lines)
    assert any(x.startswith("reduction=") for x in proc.stdout.splitlines())


@pytest.fixture(scope="module")
def bf16_rollouts(tiny_checkpoints, tmp_path_factory):
    """bf16 rollouts with enough tokens that bf16 flips some route against the fp32
    trainer (with EOS the tiny model stops early, so sampling ignores it). A bf16 row's
    numerics depend on the batch it shares, so the flips vary with the machine's load:
    32 × 32 tokens give about six, 16 × 24 sometimes none."""
    hf = tiny_checkpoints["deepseek_moe"]
    path = tmp_path_factory.mktemp("rollouts") / "bf16.jsonl"
    collect_rollouts(
        hf, path, num_prompts=32, max_new_tokens=32, dtype="bfloat16",
        sampling={"ignore_eos": True},
    )  # fmt: skip
    return hf, path


def test_recent_policy_routes_old_tokens_freshly(bf16_rollouts, tmp_path):
    """replay=recent: tokens older than the window route freshly (a bf16 rollout's routes
    then differ somewhere), tokens inside it are replayed (no flips)."""
    hf, path = bf16_rollouts
    settings = [
        ("recent", "on", {"current_version": 3, "recent_window": 5}),  # all recent: replay
        ("recent", "on", {"current_version": 3, "recent_window": 1}),  # all old: fresh
        ("off", "on"),
    ]
    inside, outside, fresh = score("single", hf, path, tmp_path / "s.json", settings=settings)
    assert inside.flip_rate == 0.0
    assert outside.flip_rate == fresh.flip_rate  # old tokens route exactly as without replay
    assert fresh.flip_rate > 0  # bf16 rollouts: some routing differs from the fp32 trainer


def test_a_policy_of_ones_own_plugs_in_by_target(bf16_rollouts, tmp_path):
    """trainer.replay={_target_: ...}: a policy defined outside moerl
    (replay_policies_for_tests) decides the trainer's routes. Checked against the
    built-ins on bf16 rollouts: returning the recorded routes scores every token exactly
    as 'all', returning the router's own choice exactly as 'none'; a policy with options
    (replay where the router's margin is small) is 'all' at an infinite threshold and
    'none' at zero."""
    hf, path = bf16_rollouts
    own = "replay_policies_for_tests."
    settings = [
        ("on", "on"),
        ({"_target_": own + "recorded"}, "on"),
        ("off", "on"),
        ({"_target_": own + "own_router"}, "on"),
        ({"_target_": own + "small_margin", "threshold": 1e9}, "on"),
        ({"_target_": own + "small_margin", "threshold": 0.0}, "on"),
    ]
    builtin_all, recorded, builtin_none, router, always, never = score(
        "single", hf, path, tmp_path / "s.json", settings=settings
    )
    assert recorded.replay == own + "recorded"
    assert recorded.flip_rate == builtin_all.flip_rate == 0.0
    assert recorded.mismatch_k3 == builtin_all.mismatch_k3
    assert recorded.max_abs_log_ratio == builtin_all.max_abs_log_ratio
    assert router.flip_rate == builtin_none.flip_rate > 0
    assert router.mismatch_k3 == builtin_none.mismatch_k3
    assert router.mismatch_k3 != builtin_all.mismatch_k3
    assert (always.flip_rate, always.mismatch_k3) == (0.0, builtin_all.mismatch_k3)
    assert (never.flip_rate, never.mismatch_k3) == (router.flip_rate, router.mismatch_k3)
