"""SGLang's /release_memory_occupation and /resume_memory_occupation on the embedded engine
(colocation: the engine gives its memory to the trainer while it trains): only when idle,
requests that arrive while released wait (never crash), released weights come back as
zeros and a push restores them (sglang/srt/managers/scheduler_components/weight_updater.py)."""

from __future__ import annotations

import subprocess
import sys
import threading

GREEDY = {
    "input_ids": [5, 6, 7],
    "sampling_params": {"max_new_tokens": 4, "temperature": 0},
    "return_logprob": True,
}
LONG = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 100, "ignore_eos": True}}

# The trainer's role: the checkpoint's tensors shared by file name, one dump per line asked.
SENDER = """
import sys, torch, torch.multiprocessing as tmp
from safetensors.torch import load_file
from moerl.engine.weights.tensor_payload import serialize_named_tensors
tmp.set_sharing_strategy("file_system")
named = [(k, v.share_memory_()) for k, v in load_file(sys.argv[1]).items()]
for line in sys.stdin:
    if not line.strip():
        break
    print(serialize_named_tensors(named), flush=True)
"""


def _until(http, what, check):  # type: ignore[no-untyped-def]
    """Poll /server_info until ``check(info)``; bounded by scheduler turns, not time."""
    start = http.get("/server_info").json()["scheduler_loops"]
    while True:
        info = http.get("/server_info").json()
        if check(info):
            return info
        assert info["scheduler_loops"] - start < 100_000, f"never {what}"


def test_release_waits_for_idle_holds_requests_and_resume_serves_them(http, tiny_checkpoints):
    before = http.post("/generate", GREEDY).json()
    box: dict = {}
    runner = threading.Thread(target=lambda: box.setdefault("long", http.post("/generate", LONG)))
    runner.start()
    _until(http, "a request running", lambda i: i["running_requests"] >= 1)
    busy = http.post("/release_memory_occupation", {"tags": ["kv_cache"]})
    assert busy.status_code == 400 and "only when server is idle" in busy.text
    http.post("/abort_request", {"abort_all": True})
    runner.join()
    assert http.post("/release_memory_occupation", {"tags": ["kv"]}).status_code == 400

    assert http.post("/release_memory_occupation", {"tags": ["kv_cache"]}).json() is None
    assert http.get("/server_info").json()["memory_released"] == ["kv_cache"]
    waiter = threading.Thread(target=lambda: box.setdefault("held", http.post("/generate", GREEDY)))
    waiter.start()
    info = _until(http, "the request queued", lambda i: i["waiting_requests"] == 1)
    turns = info["scheduler_loops"]
    _until(http, "the loop turning", lambda i: i["scheduler_loops"] > turns + 3)
    assert waiter.is_alive() and "held" not in box  # it waits while the KV pool is gone
    assert http.post("/resume_memory_occupation", {"tags": ["weights"]}).status_code == 400
    assert http.post("/resume_memory_occupation", {}).json() is None
    waiter.join()
    held = box["held"].json()
    assert held["output_ids"] == before["output_ids"]
    lp = [e[0] for e in held["meta_info"]["output_token_logprobs"]]
    want = [e[0] for e in before["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(lp, want)) < 1e-5, (lp, want)  # as below


def test_released_weights_refuse_pushes_and_come_back_with_a_push(http, tiny_checkpoints):
    before = http.post("/generate", GREEDY).json()
    (weights,) = tiny_checkpoints["qwen3_moe"].glob("*.safetensors")
    sender = subprocess.Popen(
        [sys.executable, "-c", SENDER, str(weights)], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip

    def push():  # type: ignore[no-untyped-def]
        sender.stdin.write("next\n")
        sender.stdin.flush()
        body = {"serialized_named_tensors": [sender.stdout.readline().strip()]}
        return http.post("/update_weights_from_tensor", body)

    try:
        # a push before the release: the engine keeps where each pushed tensor goes
        # (ModelRunner.load_targets), which the release and resume must forget
        assert http.post("/begin_weight_update", {}).status_code == 200
        try:
            assert push().status_code == 200
        finally:
            http.post("/end_weight_update", {})
        assert http.get("/release_memory_occupation").status_code == 200  # no body: all tags
        released = http.get("/server_info").json()["memory_released"]
        assert released == ["cuda_graph", "kv_cache", "weights"]
        assert http.post("/begin_weight_update", {}).status_code == 200
        try:
            refused = push()
            assert refused.status_code == 400 and "the weights are released" in refused.text
            assert http.post("/resume_memory_occupation", {"tags": ["weights"]}).json() is None
            loaded = push()  # the weights are zeros until this push
            assert loaded.status_code == 200, loaded.text
        finally:
            http.post("/end_weight_update", {})
        assert http.get("/resume_memory_occupation").status_code == 200  # the rest back
        after = http.post("/generate", GREEDY).json()
        assert after["output_ids"] == before["output_ids"]
        # the same weights: equal up to reduction order (a prefix-cache hit or a fresh
        # prefill computes the prompt's KV in another shape)
        lp = [e[0] for e in after["meta_info"]["output_token_logprobs"]]
        want = [e[0] for e in before["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(lp, want)) < 1e-5, (lp, want)
    finally:
        sender.communicate("\n", timeout=60)
        if http.get("/server_info").json()["memory_released"]:
            http.post("/resume_memory_occupation", {})
