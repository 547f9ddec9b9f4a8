"""moerl/engine/core/scheduler.py ``_settle``: the requests one decode step finishes go to the
prefix cache, then give their slots back highest first, so a step that finishes the
whole batch moves no KV between slots (each free moves the last used slot into the
freed one), and what is cached and served stays each request's own."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from moerl.engine.core.model_runner import ModelRunner
from moerl.engine.core.prefix_cache import PrefixCache
from moerl.engine.core.sampling import SamplingParams
from moerl.engine.core.scheduler import Request, Scheduler


def _run(
    runner: ModelRunner,
    prompts: list[list[int]],
    new: list[int],
    callbacks: list[Any] | None = None,
    answered: threading.Event | None = None,
    sched: Scheduler | None = None,
) -> Scheduler:
    """Every prompt submitted at once (one prefill, then decode steps together), greedy,
    ``new[i]`` tokens each; returns the scheduler once all were answered (``callbacks[i]``
    answers request i instead, and the run ends once ``answered`` is set; ``sched``: the
    scheduler to run them on)."""
    if sched is None:
        sched = Scheduler(runner, prefix_cache=PrefixCache(100_000), enable_routed_experts=True)
    left, done = len(prompts), answered or threading.Event()
    lock = threading.Lock()

    def on_done(_: Request) -> None:
        nonlocal left
        with lock:
            left -= 1
            if not left:
                done.set()

    reqs = [
        Request(
            rid=f"r{i}",
            input_ids=p,
            on_done=on_done if callbacks is None else callbacks[i],
            params=SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True),
        )  # fmt: skip
        for i, (p, n) in enumerate(zip(prompts, new))
    ]
    sched.submit(*reqs)
    sched.start()
    try:
        assert done.wait(120), "the requests were never answered"
    finally:
        sched.shutdown()
    sched.requests = reqs  # type: ignore[attr-defined]
    return sched


@pytest.fixture(scope="module")
def runner(tiny_checkpoints) -> ModelRunner:
    return ModelRunner(tiny_checkpoints["qwen3_moe"])


def test_a_batch_that_finishes_together_moves_no_kv(runner):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 100, n).tolist() for n in (5, 9, 7, 6, 8, 4)]
    together = _run(runner, prompts, [4] * len(prompts))
    assert together.pool.used == 0 and together.pool.moves == 0
    assert together.prefix_cache is not None and together.prefix_cache.tokens > 0
    # each request's answer is its own: the same as generated alone
    for prompt, req in zip(prompts, together.requests):  # type: ignore[attr-defined]
        alone = _run(runner, [prompt], [4]).requests[0]  # type: ignore[attr-defined]
        assert req.output_ids == alone.output_ids
        np.testing.assert_allclose(req.logprobs, alone.logprobs, rtol=1e-5, atol=1e-5)


def test_requests_that_finish_apart_still_free_their_slots(runner):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 100, n).tolist() for n in (5, 9, 7, 6)]
    apart = _run(runner, prompts, [2, 5, 3, 5])
    assert apart.pool.used == 0 and apart.pool.moves > 0  # a request outlived a lower slot


@pytest.mark.parametrize("new_tokens", [4, 1])
def test_a_step_hands_its_finished_requests_to_each_loop_at_once(runner, new_tokens):
    """Requests answered on an asyncio loop (``LoopCallback``, as the HTTP server's are)
    that one decode step finishes (or, with one new token, their prefill's first tokens)
    reach their loop in one hand-over, each resolved with its own request; a callback
    that raises does not keep the others from running, and a plain callback in the same
    step is still called. An answered request is no longer in the running batch (what
    ``/get_server_info``'s ``running_requests`` counts) when its callback runs. The
    hand-overs are counted on the real loop's ``call_soon_threadsafe``."""
    import asyncio

    from moerl.engine.core.scheduler import LoopCallback

    loop = asyncio.new_event_loop()
    handed: list[int] = []
    real = loop.call_soon_threadsafe

    def counted(callback, *args, **kwargs):  # type: ignore[no-untyped-def]
        handed.append(len(args[0]) if args and isinstance(args[0], list) else 1)
        return real(callback, *args, **kwargs)

    loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    resolved: dict[str, str] = {}
    all_in = threading.Event()

    sched = Scheduler(runner, prefix_cache=PrefixCache(100_000), enable_routed_experts=True)
    still_running: list[str] = []

    def resolve(r: Request) -> None:  # on the loop
        assert threading.current_thread() is thread
        resolved[r.rid] = "".join(map(str, r.output_ids))
        if any(x is r for x in sched.running):
            still_running.append(r.rid)
        if len(resolved) == 5:
            all_in.set()
        if r.rid == "r2":
            raise RuntimeError("a failing callback")

    plain: list[Request] = []
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 100, 4 + i).tolist() for i in range(6)]
    callbacks = [LoopCallback(loop, resolve) for _ in range(5)] + [plain.append]
    try:
        _run(runner, prompts, [new_tokens] * 6, callbacks, all_in, sched)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
    reqs = sched.requests  # type: ignore[attr-defined]
    assert handed[0] == 5  # the five finished in one step: one hand-over of five
    assert resolved == {f"r{i}": "".join(map(str, reqs[i].output_ids)) for i in range(5)}
    assert all(len(reqs[i].output_ids) == new_tokens for i in range(6))
    assert sched.pool.used == 0  # every slot given back
    assert still_running == []
    assert [r.rid for r in plain] == ["r5"]
