"""The reward-model service: completions scored by an RM over HTTP, batched, retried,
off the critical path (docs/architecture.md, "Reward models").

    rm = RewardModel(cfg.reward_model, tokenizer, urls)    # on the rollout event loop
    await rm.score(prompt, group)   # after the task's reward: rewards (and PRM steps) set
    rm.metrics()                    # reward_model/latency_s, retries, failures, ...
    await rm.aclose()

The orchestrator awaits ``score`` inside the group's own task, after generation, so a slow
RM holds up only the groups it is scoring: other groups keep generating and reaching the
buffer, and the trainer waits only as long as the buffer has no batch for it.

Batching. Every completion is one item; items are sent together in SGLang's batch form
(``input_ids`` a list of lists) once ``batch_size`` are waiting or ``linger_s`` after
the first one, so completions of different groups share a request. At most
``max_concurrency`` requests are in flight; URLs are used in turn.

Faults. A request that fails (connection error, HTTP 5xx or 429, no answer within
``timeout_s``) is sent again after ``retry_backoff_s * 2^k`` (k = retries so far, capped at
30 s), to the next URL, up to ``max_retries`` times. Then each of its items fails with a
RewardModelError, which the orchestrator treats as a failed group (its prompt generated
again after a backoff, up to rollout.max_group_attempts, then run() raises naming the RM):
retrying cannot silently drop a group, and never stops the run unannounced. HTTP 4xx
(a malformed request) is not retried and stops the run at once.
"""

from __future__ import annotations

import asyncio
import math
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
import numpy as np

from moerl.common.trajectory import Trajectory
from moerl.config.reward_model import RewardModelConfig
from moerl.engine import API_KEY_ENV
from moerl.rollout.errors import EngineError
from moerl.rollout.process_reward import (
    apply_step_rewards,
    build_step_parser,
    check_ends,
    prm_input,
)
from moerl.tasks.base import Prompt

MAX_BACKOFF_S = 30.0


class RewardModelError(EngineError):
    """The reward model failed a request after its retries (or refused it: HTTP 4xx)."""


class Transport(Protocol):
    """Sends one /generate body to a base URL and returns the parsed JSON answer."""

    async def __call__(self, url: str, body: dict[str, Any], timeout_s: float) -> Any: ...


class HttpTransport:
    """httpx POST to ``url/generate`` with the run's API key."""

    def __init__(self, api_key: str | None = None) -> None:
        key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._http = httpx.AsyncClient(headers=headers, timeout=None)

    async def __call__(self, url: str, body: dict[str, Any], timeout_s: float) -> Any:
        try:
            resp = await self._http.post(f"{url}/generate", json=body, timeout=timeout_s)
        except httpx.TimeoutException as err:
            raise RewardModelError(f"reward model {url} timed out", urls=[url]) from err
        except httpx.HTTPError as err:
            raise RewardModelError(f"reward model {url} unreachable: {err}", urls=[url]) from err
        if resp.status_code != 200:
            raise RewardModelError(
                f"reward model {url} answered HTTP {resp.status_code}: {resp.text[:300]}",
                urls=[url],
                status_code=resp.status_code,
            )
        return resp.json()

    async def aclose(self) -> None:
        await self._http.aclose()


def _retryable(err: BaseException) -> bool:
    if isinstance(err, EngineError) and err.status_code is not None:
        return err.status_code >= 500 or err.status_code == 429
    return True


@dataclass
class _Item:
    payload: list[int] | str
    future: asyncio.Future[Any]


class RewardModel:
    """Scores groups with the reward model; see the module docstring."""

    def __init__(
        self,
        cfg: RewardModelConfig,
        tokenizer: Any,
        urls: Sequence[str],
        *,
        transport: Transport | None = None,
    ) -> None:
        """tokenizer: the policy's (the PRM reads the policy's token ids; the judge reads
        text). transport: how a body reaches a URL (default: HTTP with the run's key)."""
        if not urls:
            raise ValueError("the reward model has no URL: set reward_model.urls or start engines")
        self.cfg, self.tokenizer, self.urls = cfg, tokenizer, list(urls)
        self._transport = transport or HttpTransport()
        self._next_url = 0
        self._pending: list[_Item] = []
        self._linger: asyncio.TimerHandle | None = None
        self._sending: set[asyncio.Task[None]] = set()
        self._slots = asyncio.Semaphore(cfg.max_concurrency)
        self._counts = {"requests": 0, "retries": 0, "failures": 0, "scored": 0}
        self._latency: list[float] = []
        if cfg.kind == "prm":
            self._parse = build_step_parser(cfg.step_delimiter, cfg.step_parser)
            self._tag_id = _single_token(tokenizer, cfg.step_tag)
            self._params: dict[str, Any] = {
                "sampling_params": {"max_new_tokens": 0, "temperature": 0.0},
                "return_logprob": True,
                "logprob_start_len": 0,
            }
        else:
            self._pattern = re.compile(cfg.judge_pattern)
            self._params = {
                "sampling_params": {
                    "max_new_tokens": cfg.judge_max_new_tokens,
                    "temperature": 0.0,
                }
            }

    # ---- scoring ---------------------------------------------------------------------

    async def score(self, prompt: Prompt, group: Sequence[Trajectory]) -> None:
        """Add the RM's scores to ``group``'s rewards (already set to the task's): PRM
        steps become segments (moerl.rollout.process_reward), a judge's score is added.
        Raises RewardModelError when the RM failed after its retries."""
        if self.cfg.kind == "prm":
            await asyncio.gather(*(self._score_steps(prompt, t) for t in group))
        else:
            await asyncio.gather(*(self._score_judge(prompt, t) for t in group))

    async def _score_steps(self, prompt: Prompt, traj: Trajectory) -> None:
        if traj.segments or traj.response_len == 0:  # an episode keeps its own turns
            return
        texts = list(self.tokenizer.batch_decode([[int(i)] for i in traj.response_ids]))
        ends = check_ends(self._parse(texts), traj.response_len)
        ids, tags = prm_input(traj.prompt_ids, traj.response_ids, ends, self._tag_id)
        answer = await self._request(ids)
        rows = answer["meta_info"]["input_token_logprobs"]
        scores = [math.exp(float(rows[p][0])) for p in tags]
        apply_step_rewards(traj, ends, scores, self.cfg.weight)
        traj.meta["step_scores"] = scores

    async def _score_judge(self, prompt: Prompt, traj: Trajectory) -> None:
        text = self.cfg.judge_template.format(
            prompt=prompt.text or self.tokenizer.decode(list(prompt.input_ids)),
            response=self.tokenizer.decode(list(traj.response_ids), skip_special_tokens=True),
        )
        answer = await self._request(text)
        found = self._pattern.search(str(answer.get("text", "")))
        score = float(found.group(0)) if found else 0.0
        score = score if math.isfinite(score) else 0.0
        traj.reward = float(traj.reward or 0.0) + self.cfg.weight * score
        traj.meta["judge_score"] = score

    # ---- batching --------------------------------------------------------------------

    async def _request(self, payload: list[int] | str) -> Any:
        """One item's answer, sent in a batch with whatever else is waiting."""
        loop = asyncio.get_running_loop()
        item = _Item(payload, loop.create_future())
        self._pending.append(item)
        if len(self._pending) >= self.cfg.batch_size:
            self._flush()
        elif self._linger is None:
            self._linger = loop.call_later(self.cfg.linger_s, self._flush)
        return await item.future

    def _flush(self) -> None:
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        batch, self._pending = self._pending, []
        if batch:
            task = asyncio.get_running_loop().create_task(self._send(batch))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _send(self, batch: list[_Item]) -> None:
        key = "text" if isinstance(batch[0].payload, str) else "input_ids"
        body = {key: [i.payload for i in batch], **self._params}
        try:
            async with self._slots:
                answers = await self._with_retries(body)
            if not isinstance(answers, list) or len(answers) != len(batch):
                raise RewardModelError(
                    f"reward model answered {type(answers).__name__} for a batch of {len(batch)}"
                )
        except BaseException as err:
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(err)
            if not isinstance(err, Exception):
                raise
            return
        self._counts["scored"] += len(batch)
        for item, answer in zip(batch, answers):
            if not item.future.done():  # its group may have been cancelled meanwhile
                item.future.set_result(answer)

    async def _with_retries(self, body: dict[str, Any]) -> Any:
        cfg = self.cfg
        for attempt in range(cfg.max_retries + 1):
            url = self.urls[self._next_url % len(self.urls)]
            self._next_url += 1
            start = time.perf_counter()
            self._counts["requests"] += 1
            try:
                answer = await asyncio.wait_for(
                    self._transport(url, body, cfg.timeout_s), cfg.timeout_s
                )
            except (Exception, asyncio.TimeoutError) as err:
                if isinstance(err, asyncio.TimeoutError):
                    err = RewardModelError(
                        f"reward model {url} gave no answer within {cfg.timeout_s} s", urls=[url]
                    )
                if not _retryable(err) or attempt == cfg.max_retries:
                    self._counts["failures"] += 1
                    if not _retryable(err):  # HTTP 4xx: fatal for the orchestrator
                        raise err
                    raise RewardModelError(
                        f"reward model failed {attempt + 1} times "
                        f"(reward_model.max_retries={cfg.max_retries}); last error: {err}",
                        urls=[url],
                    ) from err
                self._counts["retries"] += 1
                await asyncio.sleep(min(cfg.retry_backoff_s * 2**attempt, MAX_BACKOFF_S))
                continue
            self._latency.append(time.perf_counter() - start)
            return answer
        raise AssertionError("unreachable")

    # ---- metrics and close -----------------------------------------------------------

    def metrics(self) -> dict[str, float]:
        """Since the last call: mean and p90 request latency, requests, retries, failures,
        completions scored."""
        lat, self._latency = self._latency, []
        out = {f"reward_model/{k}": float(v) for k, v in self._counts.items()}
        self._counts = dict.fromkeys(self._counts, 0)
        out["reward_model/latency_s"] = float(np.mean(lat)) if lat else 0.0
        out["reward_model/latency_p90_s"] = float(np.percentile(lat, 90)) if lat else 0.0
        return out

    async def aclose(self) -> None:
        """Cancel requests in flight and close the HTTP client."""
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        for task in list(self._sending):
            task.cancel()
        await asyncio.gather(*self._sending, return_exceptions=True)
        close = getattr(self._transport, "aclose", None)
        if close is not None:
            await close()


def _single_token(tokenizer: Any, text: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(
            f"reward_model.step_tag={text!r} is {len(ids)} tokens for the policy's tokenizer; "
            "pick a string that is one token (e.g. '+')"
        )
    return int(ids[0])
