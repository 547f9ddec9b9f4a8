"""SGLang 0.5.23's weight-update session: /update_weights_from_distributed loads only between
/begin_weight_update and /end_weight_update, with SGLang's answers to a load outside one, a
second begin and an end without begin (sglang/srt/managers/scheduler_components/
weight_updater.py); the same client pushes to both engines."""

from __future__ import annotations

import threading

import torch

from moerl.engine.weights.group import broadcast

GREEDY = {
    "input_ids": [5, 6, 7],
    "sampling_params": {"max_new_tokens": 4, "temperature": 0},
    "return_logprob": True,
}


def _push(http, group, push, tensor):  # type: ignore[no-untyped-def]
    box: dict = {}
    sender = threading.Thread(
        target=lambda: box.setdefault("r", http.post("/update_weights_from_distributed", push))
    )
    sender.start()
    broadcast(group, tensor)
    sender.join()
    return box["r"]


def test_weights_load_only_inside_a_session(http, weight_group, tiny_checkpoints):
    from safetensors.torch import load_file

    (weights,) = tiny_checkpoints["qwen3_moe"].glob("*.safetensors")
    original = load_file(str(weights))["model.norm.weight"].float()
    before = http.post("/generate", GREEDY).json()
    norm = torch.full((64,), 3.0)
    push = {"group_name": "nf", "names": ["model.norm.weight"], "dtypes": ["float32"],
            "shapes": [[64]], "weight_version": "s1"}  # fmt: skip
    # refused before anything is received: no broadcast may follow
    outside = http.post("/update_weights_from_distributed", push)
    assert outside.status_code == 400 and outside.json()["success"] is False
    assert "must run between begin_weight_update() and end_weight_update()" in outside.text
    assert http.post("/generate", GREEDY).json()["output_ids"] == before["output_ids"]

    assert http.post("/end_weight_update", {}).json()["message"].startswith("no weight-update")
    begin = http.post("/begin_weight_update", {"selector": "all"})
    assert begin.status_code == 200 and begin.json()["success"] is True
    again = http.post("/begin_weight_update", {})
    assert again.status_code == 400 and "already open" in again.text
    assert http.post("/begin_weight_update", {"selector": "both"}).status_code == 400
    try:
        loaded = _push(http, weight_group, push, norm)
        assert loaded.status_code == 200, loaded.text
        end = http.post("/end_weight_update", None)  # no body: every field has a default
        assert end.status_code == 200 and end.json()["success"] is True
        after = http.post("/generate", GREEDY).json()
        assert after["meta_info"]["weight_version"] == "s1"
        lp = [e[0] for e in after["meta_info"]["output_token_logprobs"]]
        assert lp != [e[0] for e in before["meta_info"]["output_token_logprobs"]]
    finally:  # the session's engine is shared: its own weights back
        http.post("/begin_weight_update", {})
        restore = {**push, "weight_version": before["meta_info"]["weight_version"]}
        assert _push(http, weight_group, restore, original).status_code == 200
        http.post("/end_weight_update", {})
    assert http.post("/generate", GREEDY).json()["output_ids"] == before["output_ids"]


# Builds /update_weights_from_tensor payloads in a process of its own (the trainer's role:
# it shares its tensors by file name and keeps them alive until told to exit), one dump
# per line: a payload is read once.
SENDER = """
import sys, torch, torch.multiprocessing as tmp
from moerl.engine.weights.tensor_payload import serialize_named_tensors
tmp.set_sharing_strategy("file_system")
nan = torch.ones(64); nan[3] = float("nan")
cases = {"norm3": [("model.norm.weight", torch.full((64,), 3.0))],
         "nan": [("model.norm.weight", nan)],
         "shape": [("model.norm.weight", torch.ones(65))],
         "unknown": [("model.no_such.weight", torch.ones(64))]}
keep = {k: [(n, t.share_memory_()) for n, t in v] for k, v in cases.items()}
for line in sys.stdin:
    if not line.strip():
        break
    print(serialize_named_tensors(keep[line.strip()]), flush=True)
"""


def test_the_tensor_path_is_checked_whole_before_the_model_changes(http):
    import subprocess
    import sys

    before = http.post("/generate", GREEDY).json()
    sender = subprocess.Popen(
        [sys.executable, "-c", SENDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )

    def payload(case: str) -> str:
        sender.stdin.write(case + "\n")
        sender.stdin.flush()
        return sender.stdout.readline().strip()

    def push(case: str):  # type: ignore[no-untyped-def]
        body = {"serialized_named_tensors": [payload(case)], "weight_version": "t1"}
        return http.post("/update_weights_from_tensor", body)

    try:
        outside = push("norm3")
        assert outside.status_code == 400
        assert "must run between begin_weight_update() and end_weight_update()" in outside.text
        assert http.post("/begin_weight_update", {}).status_code == 200
        try:
            for case, words in (
                ("nan", "model.norm.weight holds NaN or inf"),
                ("shape", "got shape (65,), the model has (64,)"),
                ("unknown", "model.no_such.weight"),
            ):
                r = push(case)
                assert r.status_code == 400 and "model unchanged" in r.text, r.text
                assert words in r.text, r.text
            after = http.post("/generate", GREEDY).json()
            assert after["output_ids"] == before["output_ids"]
            assert after["meta_info"]["weight_version"] == before["meta_info"]["weight_version"]
        finally:
            http.post("/end_weight_update", {})
    finally:
        sender.communicate("\n", timeout=60)
