"""/load_lora_adapter_from_tensors with SGLang's own field, serialized_named_tensors (tensor
handles from a process on this host, read by the restricted unpickler), loads the same
adapter as moerl's safetensors_b64 bytes: the two serve identical tokens and logprobs."""

from __future__ import annotations

import base64
import subprocess
import sys

import torch
from safetensors.torch import save

O_PROJ = "base_model.model.model.layers.1.self_attn.o_proj"
CONFIG = {"r": 4, "lora_alpha": 8, "target_modules": ["o_proj"]}
GREEDY = {
    "input_ids": [5, 6, 7],
    "sampling_params": {"max_new_tokens": 6, "temperature": 0},
    "return_logprob": True,
}

SENDER = f"""
import sys, torch, torch.multiprocessing as tmp
from moerl.engine.weights.tensor_payload import serialize_named_tensors
tmp.set_sharing_strategy("file_system")
g = torch.Generator().manual_seed(0)
named = [("{O_PROJ}.lora_A.weight", torch.randn(4, 64, generator=g).share_memory_()),
         ("{O_PROJ}.lora_B.weight", torch.randn(64, 4, generator=g).share_memory_())]
print(serialize_named_tensors(named), flush=True)
sys.stdin.readline()
"""


def _adapter() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)  # the sender's draw, in its order
    return {
        f"{O_PROJ}.lora_A.weight": torch.randn(4, 64, generator=g),
        f"{O_PROJ}.lora_B.weight": torch.randn(64, 4, generator=g),
    }


def test_sglangs_serialized_adapter_serves_what_the_bytes_serve(http):
    sender = subprocess.Popen(
        [sys.executable, "-c", SENDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        dump = sender.stdout.readline().strip()
        body = {"lora_name": "handles", "config_dict": CONFIG, "serialized_named_tensors": [dump]}
        r = http.post("/load_lora_adapter_from_tensors", body)
        assert r.status_code == 200 and r.json()["success"], r.text
    finally:
        sender.communicate("\n", timeout=60)  # the engine holds its own copy now
    blob = base64.b64encode(save(_adapter())).decode()
    body = {"lora_name": "bytes", "config_dict": CONFIG, "safetensors_b64": blob}
    assert http.post("/load_lora_adapter_from_tensors", body).json()["success"]
    both = {"lora_name": "x", "config_dict": CONFIG, "safetensors_b64": blob,
            "serialized_named_tensors": [dump]}  # fmt: skip
    refused = http.post("/load_lora_adapter_from_tensors", both)
    assert refused.status_code == 400 and "one of serialized_named_tensors" in refused.text
    try:
        plain = http.post("/generate", GREEDY).json()
        a = http.post("/generate", {**GREEDY, "lora_path": "handles"}).json()
        b = http.post("/generate", {**GREEDY, "lora_path": "bytes"}).json()
        assert a["output_ids"] == b["output_ids"]
        assert a["meta_info"]["output_token_logprobs"] == b["meta_info"]["output_token_logprobs"]
        assert (
            a["meta_info"]["output_token_logprobs"] != plain["meta_info"]["output_token_logprobs"]
        )
    finally:
        for name in ("handles", "bytes"):
            http.post("/unload_lora_adapter", {"lora_name": name})
