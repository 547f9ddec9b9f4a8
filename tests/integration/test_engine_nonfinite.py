"""Issue 16, item 2: numbers that are not finite. Adapters and pushed weights holding NaN or
inf are refused whole, naming the tensor; logits that are not finite fail their request
while the engine goes on."""

from __future__ import annotations

import base64
import json
import threading

import torch
from safetensors.torch import save, save_file

from moerl.engine.weights.group import broadcast

GREEDY = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
O_PROJ = "base_model.model.model.layers.1.self_attn.o_proj"
CONFIG = {"r": 4, "lora_alpha": 8, "target_modules": ["o_proj"]}


def _adapter(a_value: float, b_value: float) -> dict[str, torch.Tensor]:
    return {
        f"{O_PROJ}.lora_A.weight": torch.full((4, 64), a_value),
        f"{O_PROJ}.lora_B.weight": torch.full((64, 4), b_value),
    }


def _from_tensors(http, name, tensors, config=CONFIG):  # type: ignore[no-untyped-def]
    blob = base64.b64encode(save(tensors)).decode()
    body = {"lora_name": name, "config_dict": config, "safetensors_b64": blob}
    return http.post("/load_lora_adapter_from_tensors", body, timeout=10)


def test_nonfinite_adapters_are_refused_naming_the_tensor(http, tmp_path):
    tensors = _adapter(0.01, 0.01)
    tensors[f"{O_PROJ}.lora_B.weight"][3, 1] = float("nan")
    r = _from_tensors(http, "nan-b64", tensors)
    assert r.status_code == 400 and f"{O_PROJ}.lora_B.weight holds NaN or inf" in r.text
    assert "nan-b64" not in r.json()["loaded_adapters"]

    bad = tmp_path / "inf-dir"
    bad.mkdir()
    tensors = _adapter(0.01, 0.01)
    tensors[f"{O_PROJ}.lora_A.weight"][0, 0] = float("inf")
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    (bad / "adapter_config.json").write_text(json.dumps(CONFIG))
    r = http.post("/load_lora_adapter", {"lora_name": "inf-dir", "lora_path": str(bad)})
    assert r.status_code == 400 and f"{O_PROJ}.lora_A.weight holds NaN or inf" in r.text

    (bad / "adapter_config.json").write_text('{"r": 4, "lora_alpha": Infinity}')
    save_file(_adapter(0.01, 0.01), str(bad / "adapter_model.safetensors"))
    r = http.post("/load_lora_adapter", {"lora_name": "inf-dir", "lora_path": str(bad)})
    assert r.status_code == 400 and "lora_alpha" in r.text
    assert http.get("/health").status_code == 200


def test_nonfinite_logits_fail_the_request_and_the_engine_goes_on(http):
    """Finite adapter weights whose product overflows fp32: the logits are NaN."""
    assert _from_tensors(http, "overflow", _adapter(1e30, 1e30)).status_code == 200
    try:
        r = http.post("/generate", {**GREEDY, "lora_path": "overflow"}, timeout=20)
        assert r.status_code == 500, r.text
        words = "logits at output token 0 are not finite (NaN or inf) with LoRA adapter 'overflow'"
        assert words in r.json()["message"]
        ok = http.post("/generate", GREEDY, timeout=20)
        assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 4
        assert http.get("/health").status_code == 200
    finally:
        http.post("/unload_lora_adapter", {"lora_name": "overflow"})


def test_nonfinite_or_impossible_weight_pushes_are_refused(http, weight_group):
    before = http.post("/generate", GREEDY).json()["output_ids"]
    push = {"group_name": "nf", "dtypes": ["float32"], "weight_version": "nan"}
    r = http.post("/update_weights_from_distributed", {**push, "names": ["x"], "shapes": [[-5]]})
    assert r.status_code == 400 and "shapes[0]" in r.text

    norm = torch.ones(64)
    norm[7] = float("nan")
    box: dict = {}
    body = {**push, "names": ["model.norm.weight"], "shapes": [[64]]}
    sender = threading.Thread(
        target=lambda: box.setdefault("r", http.post("/update_weights_from_distributed", body))
    )
    assert http.post("/begin_weight_update", {}).status_code == 200
    sender.start()
    broadcast(weight_group, norm)
    sender.join()
    assert http.post("/end_weight_update", {}).status_code == 200
    assert box["r"].status_code == 400
    assert "model unchanged" in box["r"].text and "model.norm.weight holds NaN" in box["r"].text
    after = http.post("/generate", GREEDY).json()
    assert after["output_ids"] == before and after["meta_info"]["weight_version"] != "nan"
