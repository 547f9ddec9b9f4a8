"""The EvalRunner on a scripted engine client: the metrics of a known policy, requests
kept apart from training (own rids, no routes), aborted requests generated again after
an update (drain and abort_resume), a launch while an eval runs skipped, and stop()
aborting what runs."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from moerl.common.trajectory import Trajectory
from moerl.config.eval import EvalConfig
from moerl.rollout.evaluation import EvalRunner, eval_sampling
from moerl.tasks.base import Prompt

RIGHT, WRONG = 7, 3


class EvenTask:
    """Prompt i is [i + 1]; a completion passes when it answers RIGHT."""

    def prompts(self, start: int = 0) -> Iterator[Prompt]:
        i = start
        while True:
            yield Prompt(i, np.array([i + 1], np.int32), answer=RIGHT)
            i += 1

    def reward(self, prompt: Prompt, traj: Trajectory) -> float:
        return float(traj.response_ids[0] == prompt.answer)


class ScriptedClient:
    """Greedy answers RIGHT on even prompts; sample j answers RIGHT when j < prompt id
    (so prompt 0 never passes sampled, prompt 3 passes 3 of 4). ``hold`` makes every
    request wait until aborted or released; ``abort_first`` aborts each first attempt."""

    def __init__(self, hold: bool = False, abort_first: bool = False) -> None:
        self.calls: list[dict[str, Any]] = []
        self.aborts: list[str] = []
        self.hold, self.abort_first = hold, abort_first
        self.release = asyncio.Event()
        self._aborted = asyncio.Event()

    async def generate_trajectory(self, prompt_ids: Any, params: Any, **kw: Any) -> Trajectory:
        self.calls.append({"params": dict(params), **kw})
        rid = kw["rid"]
        aborted = self.abort_first and rid.endswith("a0")
        if self.hold and not self.release.is_set():
            waits = [asyncio.ensure_future(e.wait()) for e in (self.release, self._aborted)]
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for w in waits:
                w.cancel()
            aborted = aborted or not self.release.is_set()
        pid = int(prompt_ids[0]) - 1
        if params["temperature"] == 0.0:
            token = RIGHT if pid % 2 == 0 else WRONG
        else:
            j = int(rid.split("-")[-1].split("a")[0])
            token = RIGHT if j < pid else WRONG
        n = 0 if aborted else 2
        return Trajectory(
            prompt_ids=np.asarray(prompt_ids, np.int32),
            response_ids=np.array([token, 0][:n], np.int32),
            response_logprobs=np.zeros(n, np.float32),
            versions=np.zeros(n, np.int32),
            finish_reason="abort" if aborted else "stop",
        )

    async def abort_request(self, rid: str = "") -> dict[str, Any]:
        self.aborts.append(rid)
        self._aborted.set()
        self._aborted = asyncio.Event()
        return {}


CFG = EvalConfig(every=1, num_prompts=4, greedy=True, n=4, k=[1, 2, 4], max_new_tokens=5)
SAMPLING = {"max_new_tokens": 16, "temperature": 1.0, "top_p": 0.9, "ignore_eos": True}


def runner(client: ScriptedClient, mode: str = "in_place", cfg: EvalConfig = CFG) -> EvalRunner:
    return EvalRunner(
        client,  # type: ignore[arg-type]
        {"even": EvenTask()},  # type: ignore[dict-item]
        cfg, SAMPLING, partial_rollout=mode, version=3,
    )  # fmt: skip


def test_eval_sampling_params():
    p = eval_sampling(CFG, SAMPLING)
    assert p["greedy"] == {"max_new_tokens": 5, "temperature": 0.0, "top_p": 0.9, "top_k": 1}
    assert p["sampled"] == {"max_new_tokens": 5, "temperature": 1.0, "top_p": 0.9}


def test_metrics_of_a_scripted_policy():
    async def main() -> dict[str, float]:
        client = ScriptedClient()
        r = runner(client)
        out = await r.evaluate(step=5)
        # 4 prompts x (1 greedy + 4 samples), eval rids, no routes or mask asked for
        assert len(client.calls) == 20
        assert all(c["rid"].startswith(r.prefix) for c in client.calls)
        assert all("routed_experts" not in c for c in client.calls)
        return out

    m = asyncio.run(main())
    # sampled passes per prompt: c = 0, 1, 2, 3 of n = 4
    assert m["eval/even/pass@1"] == 0.5  # greedy: prompts 0 and 2
    assert m["eval/even/pass@1_sampled"] == pytest.approx((0 + 1 + 2 + 3) / 16)
    assert m["eval/even/pass@2"] == pytest.approx((0 + 0.5 + 5 / 6 + 1) / 4)
    assert m["eval/even/pass@4"] == pytest.approx(0.75)
    assert m["eval/even/reward_mean"] == pytest.approx((2 + 6) / 20)
    assert m["eval/even/response_len_mean"] == 2.0
    assert m["eval/even/version"] == 3 and m["eval/even/version_end"] == 3
    assert m["eval/even/step"] == 5


@pytest.mark.parametrize("mode", ["drain", "abort_resume"])
def test_aborted_eval_requests_wait_for_the_update_and_start_again(mode):
    async def main() -> tuple[dict[str, float], ScriptedClient]:
        client = ScriptedClient(hold=True)
        r = runner(client, mode, EvalConfig(every=1, num_prompts=2, n=1, k=[1]))
        assert r.launch(step=1, version=3)
        while len(client.calls) < 4:  # every request is on the engine
            await asyncio.sleep(0)
        assert not r.launch(step=2, version=3)  # still running: skipped
        await r.before_update()
        if mode == "abort_resume":  # the engines abort everything themselves
            await client.abort_request(rid="")
        for _ in range(20):
            await asyncio.sleep(0)
        assert len(client.calls) == 4  # nothing is sent while the update runs
        client.release.set()
        r.after_update(4)
        await r.wait()
        return r.pop_metrics(), client

    m, client = asyncio.run(main())
    assert m["eval/even/pass@1"] == 0.5 and m["eval/even/pass@1_sampled"] == 0.5
    assert m["eval/even/version"] == 3 and m["eval/even/version_end"] == 4
    assert m["eval/reissued_total"] == 4 and m["eval/skipped_total"] == 1
    assert len(client.calls) == 8 and {c["rid"][-2:] for c in client.calls[4:]} == {"a1"}


def test_in_place_updates_leave_eval_requests_running():
    async def main() -> ScriptedClient:
        client = ScriptedClient(hold=True)
        r = runner(client, "in_place", EvalConfig(every=1, num_prompts=1, n=1, k=[1]))
        r.launch(step=0, version=0)
        while len(client.calls) < 2:
            await asyncio.sleep(0)
        assert "eval/even/pass@1" not in r.pop_metrics()  # a step's line while it runs
        await r.before_update()
        r.after_update(1)
        client.release.set()
        await r.wait()
        assert r.pop_metrics()["eval/even/version_end"] == 1
        return client

    client = asyncio.run(main())
    assert not client.aborts and len(client.calls) == 2


def test_a_held_update_starts_no_eval_request_until_after_it():
    """quiet() says whether an eval request is on the engines; before_update(hold=True)
    (a push that pauses nothing: the synchronous loop's) lets none start until
    after_update, then the eval runs on the new version."""

    async def main() -> tuple[list[bool], int, dict[str, float]]:
        client = ScriptedClient()
        r = runner(client, "in_place", EvalConfig(every=1, num_prompts=1, n=1, k=[1]))
        quiet = [r.quiet()]
        await r.before_update(hold=True)
        r.launch(step=0, version=0)
        for _ in range(20):
            await asyncio.sleep(0)
        sent = len(client.calls)
        r.after_update(1)
        await r.wait()
        return [*quiet, r.quiet()], sent, r.pop_metrics()

    quiet, sent, m = asyncio.run(main())
    assert quiet == [True, True] and sent == 0
    assert m["eval/even/version"] == 0 and m["eval/even/version_end"] == 1


def test_stop_cancels_the_eval_and_aborts_its_requests():
    async def main() -> tuple[EvalRunner, ScriptedClient]:
        client = ScriptedClient(hold=True)
        r = runner(client)
        r.launch(step=0, version=0)
        while not client.calls:
            await asyncio.sleep(0)
        await r.stop()
        return r, client

    r, client = asyncio.run(main())
    assert client.aborts == [r.prefix] and not r.running
    assert "eval/even/pass@1" not in r.pop_metrics()  # nothing was finished


def test_a_failing_eval_is_counted_and_training_goes_on():
    class Broken(ScriptedClient):
        async def generate_trajectory(self, *a: Any, **kw: Any) -> Trajectory:
            raise RuntimeError("engine gone")

    async def main() -> dict[str, float]:
        r = runner(Broken())
        r.launch(step=0, version=0)
        await r.wait()
        return r.pop_metrics()

    m = asyncio.run(main())
    assert m["eval/errors_total"] == 1 and m["eval/done_total"] == 0


class ThreeItems(EvenTask):
    """A finite set: items 0, 1, 2, then the same again (as a dataset task cycles)."""

    num_items = 3

    def prompts(self, start: int = 0) -> Iterator[Prompt]:
        for i, prompt in enumerate(super().prompts(start)):
            yield Prompt(prompt.prompt_id, np.array([(start + i) % 3 + 1], np.int32), answer=RIGHT)


def test_a_set_smaller_than_num_prompts_is_evaluated_once_each(caplog):
    """Issue 31: three test rows and eval.num_prompts=4 gave 4 prompts (a row twice),
    counting a repeat as a new prompt in pass@k."""

    async def main() -> dict[str, float]:
        client = ScriptedClient()
        r = EvalRunner(client, {"small": ThreeItems()}, CFG, SAMPLING,  # type: ignore[arg-type,dict-item]
                       partial_rollout="in_place", version=3)  # fmt: skip
        out = await r.evaluate(step=1)
        assert len(client.calls) == 3 * 5  # 3 prompts x (1 greedy + 4 samples)
        return out

    m = asyncio.run(main())
    assert m["eval/small/prompts"] == 3
    assert "has 3 items, fewer than eval.num_prompts=4" in caplog.text
    assert m["eval/small/pass@1"] == pytest.approx(2 / 3)  # greedy right on items 0 and 2
