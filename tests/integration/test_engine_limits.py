"""Issue 16, item 3: bounded work. A full queue (--max-queued-requests) answers 503 at once,
``n`` is bounded, a client that disconnects has its request aborted in the scheduler (KV
freed), streaming or not, and /health_generate generates a token or says why not."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from engine_http import Http

from moerl.engine.process import EngineProcess

LONG = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 126, "ignore_eos": True}}
ONE = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1}}


def test_a_full_queue_answers_503_at_once(http):
    """The robust engine queues at most 3 requests (its --max-queued-requests)."""
    assert http.post("/pause_generation", {"mode": "in_place"}).status_code == 200
    boxes = [{} for _ in range(3)]
    threads = [
        threading.Thread(target=lambda b=b: b.setdefault("r", http.post("/generate", ONE)))
        for b in boxes
    ]
    for t in threads:
        t.start()
    http.wait_for("3 requests queued", lambda i: i["waiting_requests"] == 3)
    full = http.post("/generate", ONE, timeout=5)
    assert full.status_code == 503 and full.json()["message"] == "The request queue is full."
    two = {**ONE, "sampling_params": {"max_new_tokens": 1, "n": 2}}
    assert http.post("/generate", two, timeout=5).status_code == 503
    assert http.info()["waiting_requests"] == 3  # the refused ones never queued
    http.post("/continue_generation")
    for t in threads:
        t.join()
    assert [b["r"].status_code for b in boxes] == [200, 200, 200]


def test_server_info_reports_the_flags(http):
    """The robust engine's --max-running-requests 4, --max-queued-requests 3, --enable-lora
    --max-lora-rank 8 under SGLang's names (internal_states as SGLang's scheduler)."""
    info = http.info()
    assert (info["max_running_requests"], info["max_queued_requests"]) == (4, 3)
    assert info["internal_states"][0]["effective_max_running_requests_per_dp"] == 4
    assert info["enable_lora"] is True and info["max_lora_rank"] == 8
    assert info["max_loras_per_batch"] == 8  # the default, as SGLang's


def test_n_is_bounded():
    from moerl.engine.validate import MAX_N, RequestError, check_generate

    with pytest.raises(RequestError, match=f"sampling_params.n: must be in 1..{MAX_N}"):
        check_generate({"input_ids": [5], "sampling_params": {"n": 200000}})


def test_n_over_the_bound_is_400(http):
    r = http.post("/generate", {**ONE, "sampling_params": {"n": 200000}}, timeout=5)
    assert r.status_code == 400 and "sampling_params.n" in r.text


@pytest.mark.parametrize("stream", [False, True])
def test_a_disconnected_client_aborts_its_waiting_request(http, stream):
    assert http.post("/pause_generation", {"mode": "in_place"}).status_code == 200
    body = {**LONG, "stream": stream}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up
        if stream:
            with httpx.stream(
                "POST", f"{http.url}/generate", json=body, headers=http.headers, timeout=1.0
            ) as r:
                for _ in r.iter_lines():
                    pass
        else:
            http.post("/generate", body, timeout=1.0)
    # still paused: only the abort can take it out of the queue
    http.wait_for("the request aborted", lambda i: i["waiting_requests"] == 0)


def test_a_disconnected_stream_frees_its_running_request(inprocess_engine):
    """The first decode step (a torch hook on the real model) waits until a control action
    is queued, so the pause lands while the request runs; the client leaves; the request
    is aborted and its KV cache freed."""
    http = Http(inprocess_engine.url, timeout=30)
    try:
        with (
            inprocess_engine.first_decode_waits_for_a_control(),
            httpx.stream("POST", f"{http.url}/generate", json={**LONG, "stream": True}) as r,
        ):
            lines = r.iter_lines()  # kept: a dropped iterator closes the connection
            next(lines)  # its first token: it is running
            assert http.post("/pause_generation", {"mode": "in_place"}).status_code == 200
            info = http.info()
            assert info["paused"] and info["running_requests"] == 1
            assert info["kv_cache_tokens"] > 0
        http.wait_for(
            "the request aborted and its KV freed",
            lambda i: i["running_requests"] == 0 and i["kv_cache_tokens"] == 0,
        )
    finally:
        http.post("/continue_generation")


def test_health_generate_generates_or_says_why_not(http):
    steps = http.info()["decode_steps"]
    assert http.get("/health_generate", timeout=20).status_code == 200
    assert http.info()["decode_steps"] > steps
    assert http.post("/pause_generation", {"mode": "in_place"}).status_code == 200
    paused = http.get("/health_generate", timeout=5)
    assert paused.status_code == 503 and "paused" in paused.json()["message"]


def test_a_disconnected_client_leaves_no_traceback_in_the_engine_log(tiny_checkpoints, tmp_path):
    """A client that leaves is routine: its requests are aborted, and the engine's log has
    no traceback or asyncio error for it."""
    log = tmp_path / "engine.log"
    eng = EngineProcess(tiny_checkpoints["deepseek_moe"], threads=1, log_path=log)
    try:
        http = Http(eng.url, timeout=30)
        assert http.post("/pause_generation", {"mode": "in_place"}).status_code == 200
        with pytest.raises(httpx.ReadTimeout):
            http.post("/generate", LONG, timeout=1.0)
        http.wait_for("the request aborted", lambda i: i["waiting_requests"] == 0)
        http.post("/continue_generation")
        time.sleep(1.0)  # the cancelled futures settle
    finally:
        eng.close()
    text = log.read_text()
    assert "Traceback" not in text and "ERROR" not in text and "CancelledError" not in text, text


def test_a_backtracking_stop_regex_ends_its_own_request_not_the_engine(http, tiny_checkpoints):
    """Issue 29: ``stop_regex`` ``(a|aa)+b`` over an output of a's backtracks exponentially
    (Python's re would search for hours by 60 tokens). The engine bounds each search
    (--stop-regex-timeout-ms, 50 ms): that request ends with a 400 naming its pattern,
    while a request sent during it, and /health, are served."""
    from moerl.models.tokenizer import load_tokenizer

    a = load_tokenizer(tiny_checkpoints["qwen3_moe"]).convert_tokens_to_ids("a")
    hostile = {
        "input_ids": [5, 6],
        "sampling_params": {"max_new_tokens": 120, "ignore_eos": True, "stop_regex": "(a|aa)+b",
                            "logit_bias": {str(a): 100.0}},
    }  # fmt: skip
    box: dict = {}
    thread = threading.Thread(target=lambda: box.setdefault("r", http.post("/generate", hostile)))
    thread.start()
    http.wait_for("the hostile request runs", lambda i: i["running_requests"] >= 1)
    other = http.post("/generate", ONE, timeout=30)  # bounded: an unbounded search never ends
    assert other.status_code == 200 and len(other.json()["output_ids"]) == 1
    thread.join(timeout=60)
    assert not thread.is_alive(), "the hostile request did not end"
    answer = box["r"]
    assert answer.status_code == 400, answer.text
    message = answer.json()["error"]["message"] if "error" in answer.json() else answer.text
    assert "(a|aa)+b" in message and "--stop-regex-timeout-ms" in message
    assert http.get("/health", timeout=5).status_code == 200


def test_a_submission_larger_than_the_batch_does_not_queue_others_behind_all_of_it(
    tiny_checkpoints,
):
    """One request with n=40 on an engine of 4 running slots: a request sent after it waits
    behind one batch of it, not all 40 (each admission tops the queue up to one batch from
    its backlog), so it is answered first; every sample still comes back, and an abort
    reaches the samples still in the backlog."""
    import asyncio

    from moerl.engine.inprocess import InProcessEngine, engine_mounts

    eng = InProcessEngine(
        tiny_checkpoints["qwen3_moe"], "--max-running-requests", "4", "--disable-radix-cache"
    )
    sched = eng.state.scheduler
    big = {"input_ids": [5, 6, 7], "rid": "big",
           "sampling_params": {"max_new_tokens": 8, "n": 40, "ignore_eos": True}}  # fmt: skip
    small = {"input_ids": [9, 4], "rid": "small",
             "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}  # fmt: skip

    async def run() -> list[str]:
        async with httpx.AsyncClient(mounts=engine_mounts([eng]), timeout=120) as client:
            first = asyncio.create_task(client.post(f"{eng.url}/generate", json=big))
            while sched.queued() + len(sched.running) < 40:  # all of it submitted
                await asyncio.sleep(0.001)
            second = asyncio.create_task(client.post(f"{eng.url}/generate", json=small))
            order = []
            for done in asyncio.as_completed([first, second]):
                r = await done
                assert r.status_code == 200, r.text
                body = r.json()
                order.append("big" if isinstance(body, list) else "small")
                if isinstance(body, list):
                    assert len(body) == 40
                    assert all(b["meta_info"]["completion_tokens"] == 8 for b in body)
            return order

    try:
        assert asyncio.run(run()) == ["small", "big"]
        assert sched.queued() == 0 and not sched.backlog
        # an abort reaches the samples still in the backlog
        assert sched.max_running == 4
        sched.pause("in_place")
        many = [_request(i) for i in range(10)]
        sched.submit(*many)
        assert len(sched.backlog) == 6 and sched.queued() == 10
        done = []
        sched.control(lambda: sched.abort(abort_all=True), lambda r, e: done.append((r, e)))
        sched.resume()
        deadline = time.monotonic() + 30
        while not done and time.monotonic() < deadline:
            time.sleep(0.01)
        assert done and done[0][0] == 10 and all(r.done for r in many)
        assert sched.queued() == 0
    finally:
        eng.close()


def _request(i: int):  # type: ignore[no-untyped-def]
    from moerl.engine.core.sampling import SamplingParams
    from moerl.engine.core.scheduler import Request

    return Request(rid=f"q{i}", input_ids=[5, 6], params=SamplingParams.from_request({}, 128))
