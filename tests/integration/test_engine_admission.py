"""An idle engine that gets a request waits for the requests sent with it
(``--admission-wait-ms`` / ``--admission-quiet-ms``), so they prefill in one forward.

The forwards are read from a spy around the engine's own ``ModelRunner.extend`` (the
real one runs). The second request is sent once the scheduler counts itself waiting
(``admission_waits``), never after a sleep: without the wait, the first request would
have been prefilled alone by then."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from moerl.engine.cli import parse_args
from moerl.engine.inprocess import InProcessEngine, engine_mounts


def _body(ids: list[int], rid: str) -> dict[str, Any]:
    return {
        "input_ids": ids,
        "rid": rid,
        "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True},
    }


class ExtendSpy:
    """Records the rows (token counts) of every extend forward."""

    def __init__(self, engine: InProcessEngine) -> None:
        self.runner = engine.state.runner
        self.rows: list[list[int]] = []
        self._extend = self.runner.extend

        def extend(pool, slots, rows, *args, **kwargs):  # type: ignore[no-untyped-def]
            self.rows.append([len(r) for r in rows])
            return self._extend(pool, slots, rows, *args, **kwargs)

        self.runner.extend = extend

    def close(self) -> None:
        self.runner.extend = self._extend


async def _until(condition: Any, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.001)  # polling a counter, not timing anything


@pytest.fixture
def waiting_engine(tiny_checkpoints):  # type: ignore[no-untyped-def]
    # a wait that never ends by time in this test: only a full prefill ends it
    eng = InProcessEngine(
        tiny_checkpoints["deepseek_moe"], "--max-running-requests", "2",
        "--admission-wait-ms", "600000", "--admission-quiet-ms", "600000",
        "--disable-radix-cache",
    )  # fmt: skip
    yield eng
    eng.close()


def test_requests_sent_together_prefill_together(waiting_engine):
    eng, scheduler = waiting_engine, waiting_engine.state.scheduler
    spy = ExtendSpy(eng)

    async def run() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(mounts=engine_mounts([eng]), timeout=120) as client:
            first = asyncio.create_task(
                client.post(f"{eng.url}/generate", json=_body([5, 17, 3], "first"))
            )
            await _until(lambda: scheduler.admission_waits == 1, "the idle engine's wait")
            assert spy.rows == []  # the first request waits for company
            second = await client.post(f"{eng.url}/generate", json=_body([9, 4, 8, 2, 6], "second"))
            return [(await first).json(), second.json()]

    try:
        answers = asyncio.run(run())
    finally:
        spy.close()
    assert [a["meta_info"]["completion_tokens"] for a in answers] == [3, 3]
    # both prompts in the first forward (the batch was full: max_running_requests=2)
    assert sorted(spy.rows[0]) == [3, 5]
    assert sum(1 for rows in spy.rows if rows) == 1


def test_a_lone_request_waits_only_the_quiet_window(tiny_checkpoints):
    """A long wait with a short quiet window: a request nobody follows is admitted once
    the window passes, and an engine that is already decoding admits at once."""
    eng = InProcessEngine(
        tiny_checkpoints["deepseek_moe"], "--admission-wait-ms", "600000",
        "--admission-quiet-ms", "20", "--disable-radix-cache",
    )  # fmt: skip
    try:

        async def run() -> dict[str, Any]:
            async with httpx.AsyncClient(mounts=engine_mounts([eng]), timeout=60) as client:
                return (await client.post(f"{eng.url}/generate", json=_body([7, 1], "lone"))).json()

        answer = asyncio.run(run())
    finally:
        eng.close()
    assert answer["meta_info"]["completion_tokens"] == 3
    assert eng.state.scheduler.admission_waits == 1


def test_admission_flags_are_checked():
    with pytest.raises(SystemExit):
        parse_args(["--model-path", "x", "--admission-wait-ms", "-1"])
    args = parse_args(["--model-path", "x"])
    assert (args.admission_wait_ms, args.admission_quiet_ms) == (4.0, 1.0)
    no_wait = parse_args(["--model-path", "x", "--admission-wait-ms", "0"])
    assert no_wait.admission_wait_ms == 0


def test_an_idle_engine_admits_once_as_many_wait_as_its_last_busy_spell_took(
    tiny_checkpoints,
):
    """A synchronous loop sends as many requests every step: once as many wait as the
    last busy spell admitted, the wait ends without its quiet window (here 10 minutes,
    so only the count can end it); fewer wait the window out, as before. While the
    engine waits, a submission that does not end the wait does not wake it (the wakes
    are counted on the scheduler's ``threading.Event``)."""
    eng = InProcessEngine(
        tiny_checkpoints["deepseek_moe"], "--max-running-requests", "8",
        "--admission-wait-ms", "600000", "--admission-quiet-ms", "600000",
        "--disable-radix-cache",
    )  # fmt: skip
    scheduler = eng.state.scheduler
    spy = ExtendSpy(eng)
    prompts = [[5, 17, 3], [9, 4, 8, 2, 6], [7, 1]]
    wakes, wake = [0], scheduler.wake.set

    def counted() -> None:
        wakes[0] += 1
        wake()

    scheduler.wake.set = counted  # type: ignore[method-assign]

    async def run() -> None:
        async with httpx.AsyncClient(mounts=engine_mounts([eng]), timeout=120) as client:
            # the first spell: three prompts in one batched request, a short window
            scheduler.admission_quiet_s = 0.001
            batch = {**_body([], "batch"), "input_ids": prompts, "rid": ["a", "b", "c"]}
            first = (await client.post(f"{eng.url}/generate", json=batch)).json()
            assert [a["meta_info"]["completion_tokens"] for a in first] == [3, 3, 3]
            assert scheduler.admitted_by_count == 0  # no spell before it to count on
            # the next: the same three, one request each, under the 10-minute window
            scheduler.admission_quiet_s = 600.0
            sent = []
            for i, ids in enumerate(prompts):
                body = _body(ids, f"step-{i}")
                sent.append(asyncio.create_task(client.post(f"{eng.url}/generate", json=body)))
                if i == 0:  # the idle engine counts itself waiting before the others go
                    await _until(lambda: scheduler.admission_waits == 2, "the second wait")
                    waiting = wakes[0]
            answers = await asyncio.wait_for(asyncio.gather(*sent), 60)
            assert wakes[0] - waiting == 1  # the third submission's, which ends the wait
            assert [a.json()["meta_info"]["completion_tokens"] for a in answers] == [3, 3, 3]
            assert scheduler.admitted_by_count == 1
            assert scheduler.expected_arrivals == 3
            # fewer than the last spell: the (now short) quiet window ends the wait
            scheduler.admission_quiet_s = 0.001
            lone = (await client.post(f"{eng.url}/generate", json=_body([4, 4], "lone"))).json()
            assert lone["meta_info"]["completion_tokens"] == 3
            assert (scheduler.admitted_by_count, scheduler.admission_waits) == (1, 3)

    try:
        asyncio.run(run())
    finally:
        spy.close()
        eng.close()
    prefills = [sorted(rows) for rows in spy.rows if rows]
    # each spell's prompts in one forward: the batch, the three sent apart, the lone one
    assert prefills == [[2, 3, 5], [2, 3, 5], [2]]
