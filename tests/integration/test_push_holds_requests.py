"""A generation request that reaches the engine while a pushed bucket is on its way
starts on the pushed weights (SGLang's requests wait on the update's lock the same way),
and the trainer's ``WeightSync.push`` says so as soon as the bucket is off the wire, so
the synchronous loop sends its next requests while the engine still loads it.

Orders are read from the engine's own counters (its admission holds, its queue, its
loop's turns), never from sleeps."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest
import torch
from engine_http import InProcessEngine, WeightTrainer, checkpoint_tensors

from moerl.engine.weights.bucket import dtype_name
from moerl.engine.weights.group import broadcast
from moerl.sync.weights import WeightSync

GREEDY = {
    "input_ids": [5, 17, 3, 9],
    "sampling_params": {"max_new_tokens": 4, "temperature": 0},
    "return_logprob": True,
}
NORM = "model.norm.weight"


@pytest.fixture(scope="module")
def engine(own_engine: InProcessEngine) -> InProcessEngine:
    return own_engine


@pytest.fixture(scope="module")
def trainer(engine) -> WeightTrainer:
    return WeightTrainer(engine.url)


@pytest.fixture(scope="module")
def norm(tiny_checkpoints) -> torch.Tensor:
    return checkpoint_tensors(tiny_checkpoints["qwen3_moe"])[NORM]


def _until(what: str, predicate: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.001)


def _in_thread(fn: Any) -> tuple[threading.Thread, dict[str, Any]]:
    box: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: box.setdefault("r", fn()))
    thread.start()
    return thread, box


def _logprobs(answer: dict[str, Any]) -> list[Any]:
    return answer["meta_info"]["output_token_logprobs"]  # type: ignore[no-any-return]


def _generate(engine: InProcessEngine) -> dict[str, Any]:
    r = httpx.post(f"{engine.url}/generate", json=GREEDY, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _push_while_a_request_arrives(
    engine: InProcessEngine, trainer: WeightTrainer, value: torch.Tensor, version: str
) -> tuple[dict[str, Any], httpx.Response]:
    """Post a bucket of ``NORM`` (not yet broadcast), then a greedy request once the
    engine holds its admission for the bucket; show that the request waits (queued over
    several turns of the scheduler's loop, nothing running); then broadcast. Returns the
    request's answer and the push's."""
    sched = engine.state.scheduler
    body = {
        "names": [NORM], "dtypes": [dtype_name(value.dtype)], "shapes": [list(value.shape)],
        "group_name": "wu", "weight_version": version, "flush_cache": False,
    }  # fmt: skip
    assert httpx.post(f"{engine.url}/begin_weight_update", json={}).json()["success"]
    try:
        held = sched.holds
        push, pushed = _in_thread(
            lambda: httpx.post(
                f"{engine.url}/update_weights_from_distributed", json=body, timeout=60
            )
        )
        _until("the push holds admission", lambda: sched.holds == held + 1)
        arrived = sched._arrived
        request, answer = _in_thread(lambda: _generate(engine))
        _until("the request is queued", lambda: sched._arrived == arrived + 1)
        turns = sched.loops
        _until("three turns of the scheduler's loop", lambda: sched.loops >= turns + 3)
        assert sched.queued() == 1 and not sched.running and request.is_alive()
        broadcast(trainer.group, value.contiguous())
        push.join(60)
        request.join(60)
    finally:
        assert httpx.post(f"{engine.url}/end_weight_update", json={}).json()["success"]
    assert sched.holds == held
    return answer["r"], pushed["r"]


def test_a_request_arriving_during_a_push_starts_on_the_pushed_weights(engine, trainer, norm):
    before = _generate(engine)
    answer, push = _push_while_a_request_arrives(engine, trainer, norm * 3.0, "held-1")
    assert push.status_code == 200, push.text
    assert answer["meta_info"]["weight_version"] == "held-1"
    # the same request on the pushed weights, run alone as it was (not from the cache)
    assert httpx.post(f"{engine.url}/flush_cache", timeout=30).status_code == 200
    after = _generate(engine)
    assert answer["output_ids"] == after["output_ids"]
    assert _logprobs(answer) == _logprobs(after) != _logprobs(before)
    _push_while_a_request_arrives(engine, trainer, norm, "held-restored")


def test_a_refused_push_lets_the_waiting_request_start_on_the_old_weights(engine, trainer, norm):
    # both runs prefill the whole prompt: the last test's request may have cached it, and
    # a prefix read from the cache need not give a full prefill's bits
    assert httpx.post(f"{engine.url}/flush_cache", timeout=30).status_code == 200
    before = _generate(engine)
    bad = norm.clone()
    bad[3] = float("nan")
    assert httpx.post(f"{engine.url}/flush_cache", timeout=30).status_code == 200
    answer, push = _push_while_a_request_arrives(engine, trainer, bad, "held-nan")
    assert push.status_code == 400 and f"{NORM} holds NaN" in push.text
    assert answer["meta_info"]["weight_version"] == before["meta_info"]["weight_version"]
    assert answer["output_ids"] == before["output_ids"]
    assert _logprobs(answer) == _logprobs(before)


@pytest.mark.parametrize("own", [True, False], ids=["own_engines", "sglang_session"])
def test_push_is_ready_for_requests_as_soon_as_they_would_start_on_its_weights(engine, norm, own):
    """``on_ready`` with moerl's own engines (the session kept open): called while the
    engine's scheduler cannot load anything yet (a control holds it until ``on_ready``
    runs), so before the engine answered. SGLang's sessions end after the answers (its
    weights are post-processed then): ``on_ready`` comes once the session ended. Either
    way a request sent from it carries the pushed version."""
    sched = engine.state.scheduler
    version = 11 if own else 12
    unblocked, go = threading.Event(), threading.Event()
    seen: dict[str, Any] = {}

    def block() -> None:
        go.wait(30)
        unblocked.set()

    def on_ready() -> None:
        seen["while_blocked"] = not unblocked.is_set()
        seen["session_open"] = engine.state.weight_session
        seen["calls"] = seen.get("calls", 0) + 1
        seen["request"] = _in_thread(lambda: _generate(engine))
        go.set()

    with WeightSync([], None, urls=[engine.url], keep_session=own) as sync:
        assert sync.early_ready is own
        if own:
            sched.control(block, lambda *_: None)
        stats = sync.push(version, named=[(NORM, norm.clone())], on_ready=on_ready)
        go.set()
    thread, answer = seen["request"]
    thread.join(60)
    assert stats["tensors"] == 1 and seen["calls"] == 1
    if own:  # before the engine could load the bucket, so before it answered
        assert seen["while_blocked"] and seen["session_open"]
    else:  # after the session's end
        assert not seen["session_open"]
    assert answer["r"]["meta_info"]["weight_version"] == str(version)
    assert not engine.state.weight_session  # closing the sync ended a kept session
