"""SGLang 0.5.23's weight-update session: /update_weights_from_distributed loads only between
/begin_weight_update and /end_weight_update, with SGLang's answers to a load outside one, a
second begin and an end without begin (sglang/srt/managers/scheduler_components/
weight_updater.py); the same client pushes to both engines."""

from __future__ import annotations

import threading

import torch

from moerl.engine.group import broadcast

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
