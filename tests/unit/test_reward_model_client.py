"""The reward-model client's batching, retries and timeouts against a real local HTTP
server (a small FastAPI app on uvicorn in a thread) that fails or stalls on command:
a real RM engine cannot be made to fail like this on purpose. Its answers mimic SGLang's
/generate batch form; tests/integration/test_reward_model.py scores with a real engine."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from moerl.common.trajectory import Trajectory
from moerl.config.reward_model import RewardModelConfig
from moerl.models.tokenizer import build_tiny_tokenizer
from moerl.parallel.spawn import free_port
from moerl.rollout.reward_model import HttpTransport, RewardModel, RewardModelError
from moerl.tasks.base import Prompt

TOK = build_tiny_tokenizer()
LOGPROB = math.log(0.25)


class FlakyServer:
    """/generate answers every prompt of a batch with input logprobs log(0.25); the next
    ``fail`` requests answer HTTP ``status``, the next ``stall`` ones sleep ``stall_s``."""

    def __init__(self) -> None:
        self.fail = self.stall = 0
        self.status, self.stall_s = 503, 5.0
        self.bodies: list[dict[str, Any]] = []
        app = FastAPI()

        @app.post("/generate")
        async def generate(request: Request) -> Any:
            body = await request.json()
            self.bodies.append(body)
            if self.fail:
                self.fail -= 1
                return JSONResponse({"error": "down"}, status_code=self.status)
            if self.stall:
                self.stall -= 1
                await asyncio.sleep(self.stall_s)
            prompts = body.get("input_ids") or [[0]] * len(body["text"])
            rows = [[[LOGPROB, t, ""] for t in ids] for ids in prompts]
            for r in rows:
                r[0][0] = None
            return [{"text": "7", "meta_info": {"input_token_logprobs": r}} for r in rows]

        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def server() -> Iterator[FlakyServer]:
    s = FlakyServer()
    yield s
    s.close()


@pytest.fixture(autouse=True)
def _reset(server: FlakyServer) -> None:
    server.fail = server.stall = 0
    server.status = 503
    server.bodies.clear()


def _group(n: int, text: str = "12,34,5") -> tuple[Prompt, list[Trajectory]]:
    ids = TOK.encode(text, add_special_tokens=False)
    trajs = [
        Trajectory(
            prompt_ids=[1, 5],
            response_ids=ids,
            response_logprobs=np.zeros(len(ids)),
            versions=np.zeros(len(ids)),
            reward=1.0,
            group_id=0,
            index=i,
        )  # fmt: skip
        for i in range(n)
    ]
    return Prompt(0, np.array([1, 5], np.int32), text="q"), trajs


def _score(cfg: RewardModelConfig, url: str, *groups: tuple[Prompt, list[Trajectory]]) -> Any:
    async def go() -> dict[str, float]:
        rm = RewardModel(cfg, TOK, [url], transport=HttpTransport(api_key=""))
        try:
            await asyncio.gather(*(rm.score(p, g) for p, g in groups))
            return rm.metrics()
        finally:
            await rm.aclose()

    return asyncio.run(go())


def test_prm_batches_completions_of_several_groups(server):
    cfg = RewardModelConfig(enabled=True, step_delimiter=",", batch_size=4, linger_s=0.05)
    a, b = _group(3), _group(2)
    metrics = _score(cfg, server.url, a, b)
    assert [len(body["input_ids"]) for body in server.bodies] == [4, 1]  # 5 items, batch 4
    assert server.bodies[0]["return_logprob"] and server.bodies[0]["logprob_start_len"] == 0
    for t in a[1] + b[1]:
        assert [(s.start, s.end) for s in t.segments] == [(0, 3), (3, 6), (6, 7)]
        assert [s.reward for s in t.segments] == pytest.approx([0.25, 0.25, 1.25])
        assert t.reward == pytest.approx(1.75)
    assert metrics["reward_model/requests"] == 2 and metrics["reward_model/scored"] == 5
    assert metrics["reward_model/retries"] == 0 and metrics["reward_model/latency_s"] > 0


def test_failed_requests_are_retried_with_backoff(server):
    server.fail = 2
    cfg = RewardModelConfig(enabled=True, step_delimiter=",", max_retries=2, retry_backoff_s=0.01)
    prompt, group = _group(2)
    metrics = _score(cfg, server.url, (prompt, group))
    assert len(server.bodies) == 3
    assert metrics["reward_model/retries"] == 2 and metrics["reward_model/failures"] == 0
    assert all(len(t.segments) == 3 for t in group)


def test_a_stalled_request_times_out_and_is_retried(server):
    server.stall = 1
    cfg = RewardModelConfig(
        enabled=True, step_delimiter=",", timeout_s=0.3, max_retries=1, retry_backoff_s=0.01
    )
    metrics = _score(cfg, server.url, _group(1))
    assert metrics["reward_model/retries"] == 1 and metrics["reward_model/failures"] == 0


def test_retries_run_out_into_a_reward_model_error(server):
    server.fail = 10
    cfg = RewardModelConfig(enabled=True, step_delimiter=",", max_retries=2, retry_backoff_s=0.01)
    with pytest.raises(RewardModelError, match="failed 3 times") as err:
        _score(cfg, server.url, _group(2))
    assert err.value.status_code is None  # not fatal: the orchestrator requeues the group
    assert len(server.bodies) == 3


def test_a_refused_request_is_not_retried(server):
    server.fail, server.status = 10, 400
    cfg = RewardModelConfig(enabled=True, step_delimiter=",", max_retries=3)
    with pytest.raises(RewardModelError, match="HTTP 400") as err:
        _score(cfg, server.url, _group(1))
    assert err.value.status_code == 400 and len(server.bodies) == 1


def test_judge_parses_the_score_from_the_answer(server):
    cfg = RewardModelConfig(enabled=True, kind="judge", weight=0.5)
    prompt, group = _group(2, "12")
    _score(cfg, server.url, (prompt, group))
    assert server.bodies[0]["text"] == ["question: q answer: 12 score:"] * 2
    assert [t.reward for t in group] == [4.5, 4.5]  # 1.0 + 0.5 * 7
    assert [t.meta["judge_score"] for t in group] == [7.0, 7.0]
    assert not group[0].segments
