"""The reward-model service against a real embedded RM engine (the tiny model, random
weights: its scores mean nothing, the logprob plumbing is real), and inside the
orchestrator: a slow RM delays only its own groups; a failing one fails its groups through
the fault policy and stops the run with its error, never silently."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

from moerl.common.trajectory import Trajectory
from moerl.config.buffer import BufferConfig, StalenessConfig
from moerl.config.reward_model import RewardModelConfig
from moerl.config.rollout import RolloutConfig
from moerl.models.tokenizer import build_tiny_tokenizer
from moerl.rollout import EngineClient
from moerl.rollout.buffer import RolloutBuffer
from moerl.rollout.errors import EngineError
from moerl.rollout.orchestrator import Orchestrator
from moerl.rollout.reward_model import RewardModel, RewardModelError
from moerl.tasks import build_task
from moerl.tasks.base import Prompt

TOK = build_tiny_tokenizer()
CFG = RolloutConfig(group_size=2, max_inflight_groups=2, max_new_tokens=8, top_k=20)
PRM = RewardModelConfig(enabled=True, step_delimiter=",", batch_size=8, linger_s=0.01)


@pytest.fixture(scope="module")
def rm_engine(tiny_checkpoints, engine_factory):  # type: ignore[no-untyped-def]
    """A reward-model engine: the tiny DeepSeek model, no routing capture, no updates."""
    return engine_factory(tiny_checkpoints["deepseek_moe"])


def _traj(index: int, text: str) -> Trajectory:
    ids = TOK.encode(text, add_special_tokens=False)
    R = len(ids)
    return Trajectory(
        prompt_ids=[1, 5, 6], response_ids=ids, response_logprobs=np.zeros(R),
        versions=np.zeros(R), reward=1.0, group_id=0, index=index,
    )  # fmt: skip


def test_prm_scores_a_batch_on_a_real_engine(rm_engine):
    group = [_traj(0, "12,34,5"), _traj(1, "9,8"), _traj(2, "777")]
    prompt = Prompt(0, np.array([1, 5, 6], np.int32))

    async def go():  # type: ignore[no-untyped-def]
        rm = RewardModel(PRM, TOK, [rm_engine.url])
        try:
            await rm.score(prompt, group)
            metrics = rm.metrics()
            # the first step of the first completion, asked for alone: the same score
            tag = TOK.encode("+", add_special_tokens=False)[0]
            alone = await rm._transport(
                rm_engine.url,
                {"input_ids": [1, 5, 6, *group[0].response_ids[:3].tolist(), tag],
                 "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
                 "logprob_start_len": 0},
                30.0,
            )  # fmt: skip
            return metrics, alone
        finally:
            await rm.aclose()

    metrics, alone = asyncio.run(go())
    assert metrics["reward_model/requests"] == 1  # one batch for the group
    assert [len(t.segments) for t in group] == [3, 2, 1]
    for t in group:
        scores = t.meta["step_scores"]
        assert all(0 < s <= 1 for s in scores)
        assert t.reward == pytest.approx(1.0 + sum(scores))
        t.validate()
    first = math.exp(alone["meta_info"]["input_token_logprobs"][-1][0])
    assert group[0].meta["step_scores"][0] == pytest.approx(first, rel=1e-4)


def test_judge_on_a_real_engine(rm_engine):
    group = [_traj(0, "12"), _traj(1, "34")]
    cfg = RewardModelConfig(enabled=True, kind="judge", judge_max_new_tokens=4)

    async def go() -> None:
        rm = RewardModel(cfg, TOK, [rm_engine.url])
        try:
            await rm.score(Prompt(0, np.array([1, 5], np.int32), text="q"), group)
        finally:
            await rm.aclose()

    asyncio.run(go())
    for t in group:  # whatever the random model wrote, a finite score was parsed (or 0)
        assert math.isfinite(t.meta["judge_score"])
        assert t.reward == pytest.approx(1.0 + t.meta["judge_score"])


class GatedRM(RewardModel):
    """The real client whose scoring of prompt 0 waits for a gate: a slow RM request."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.gate = asyncio.Event()
        self.scoring: set[int] = set()

    async def score(self, prompt, group):  # type: ignore[no-untyped-def]
        self.scoring.add(prompt.prompt_id)
        if prompt.prompt_id == 0:
            await self.gate.wait()
        await super().score(prompt, group)


def test_a_slow_reward_model_delays_only_its_groups(ds_engine, rm_engine):
    task = build_task("copy_digits", TOK)
    cfg = RolloutConfig(group_size=2, max_inflight_groups=2, max_new_tokens=8, top_k=20,
                        return_routed_experts=False)  # fmt: skip

    async def go():  # type: ignore[no-untyped-def]
        async with EngineClient([ds_engine.url]) as client:
            buffer = RolloutBuffer(BufferConfig(max_groups=8), StalenessConfig(throttle=False))
            rm = GatedRM(PRM, TOK, [rm_engine.url])
            orch = Orchestrator(client, task, buffer, cfg, num_layers=4, topk=4, reward_model=rm)
            runner = asyncio.create_task(orch.run())
            try:
                # prompt 0's scoring is held; the trainer's batches come from the others
                first = await asyncio.wait_for(buffer.get_batch(3, 0), 60)
                assert 0 in rm.scoring and 0 not in {g[0].group_id for g in first}
                rm.gate.set()
                later = await asyncio.wait_for(buffer.get_batch(4, 0), 60)
                return first, later, orch.metrics()
            finally:
                await orch.stop()
                await runner

    first, later, metrics = asyncio.run(go())
    assert 0 in {g[0].group_id for g in later}  # once the RM answered, it arrived
    for group in first + later:
        for t in group:
            assert t.segments and t.meta["step_scores"]
    assert metrics["reward_model/scored"] >= 2 * 7 and metrics["reward_model/failures"] == 0


class DownTransport:
    """An RM that answers HTTP 503 to every request (counted)."""

    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, url, body, timeout_s):  # type: ignore[no-untyped-def]
        self.calls += 1
        raise RewardModelError("HTTP 503", urls=[url], status_code=503)


def test_a_failing_reward_model_fails_its_groups_then_the_run(ds_engine):
    task = build_task("copy_digits", TOK)
    cfg = RolloutConfig(group_size=2, max_inflight_groups=1, max_new_tokens=4, top_k=20,
                        return_routed_experts=False, max_group_attempts=2,
                        group_retry_backoff_s=0.01)  # fmt: skip
    down = DownTransport()
    rm_cfg = RewardModelConfig(enabled=True, step_delimiter=",", max_retries=1,
                               retry_backoff_s=0.0)  # fmt: skip

    async def go():  # type: ignore[no-untyped-def]
        async with EngineClient([ds_engine.url]) as client:
            buffer = RolloutBuffer(BufferConfig(max_groups=4), StalenessConfig(throttle=False))
            rm = RewardModel(rm_cfg, TOK, ["http://rm"], transport=down)
            orch = Orchestrator(client, task, buffer, cfg, num_layers=4, topk=4, reward_model=rm)
            with pytest.raises(EngineError, match="reward model failed 2 times"):
                await asyncio.wait_for(orch.run(), 60)
            return orch.metrics()

    metrics = asyncio.run(go())
    assert metrics["rollout/group_failures"] >= 2  # generated again, then given up on
    assert metrics["reward_model/failures"] >= 2 and down.calls >= 4
