"""LoRA in the embedded engine: adapters on attention and dense MLP layers.

The reference is a checkpoint with the adapter merged into the base weights
(W + scaling · B A), served by a second engine with LoRA off.
"""

from __future__ import annotations

import base64
import io
import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from safetensors.torch import load_file, save, save_file

TARGETS = ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA = 4, 8
BODY = {
    "input_ids": [5, 6, 7, 8],
    "sampling_params": {"max_new_tokens": 8, "temperature": 0},
    "return_logprob": True,
}


def _adapter(base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Random LoRA pairs for attention of every layer and the dense MLP of layer 0."""
    gen = torch.Generator().manual_seed(5)
    out = {}
    for name, w in base.items():
        parts = name.split(".")
        if len(parts) < 5 or parts[-2] not in TARGETS or "experts" in name:
            continue
        module = name.removesuffix(".weight")
        out[f"base_model.model.{module}.lora_A.weight"] = 0.3 * torch.randn(
            RANK, w.shape[1], generator=gen
        )
        out[f"base_model.model.{module}.lora_B.weight"] = 0.3 * torch.randn(
            w.shape[0], RANK, generator=gen
        )
    return out


def _config() -> dict:
    return {"r": RANK, "lora_alpha": ALPHA, "target_modules": TARGETS, "peft_type": "LORA"}


@pytest.fixture(scope="module")
def lora_setup(tiny_checkpoints, engine_factory, tmp_path_factory):
    base_dir = tiny_checkpoints["qwen3_moe"]
    base = load_file(str(base_dir / "model.safetensors"))
    adapter = _adapter(base)
    adapter_dir = tmp_path_factory.mktemp("adapter")
    save_file(adapter, str(adapter_dir / "adapter_model.safetensors"))
    (adapter_dir / "adapter_config.json").write_text(json.dumps(_config()))
    merged_dir = tmp_path_factory.mktemp("merged") / "hf"
    shutil.copytree(base_dir, merged_dir)
    merged = dict(base)
    for key, a in adapter.items():
        if key.endswith("lora_A.weight"):
            module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            b = adapter[key.replace("lora_A", "lora_B")]
            merged[f"{module}.weight"] = base[f"{module}.weight"] + (ALPHA / RANK) * b @ a
    save_file(merged, str(merged_dir / "model.safetensors"))
    lora_engine = engine_factory(
        base_dir, "--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", *TARGETS
    )
    merged_engine = engine_factory(merged_dir)
    return lora_engine, merged_engine, adapter_dir, adapter


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=120)


def _same(a: dict, b: dict) -> None:
    assert a["output_ids"] == b["output_ids"]
    for (x, _, _), (y, _, _) in zip(
        a["meta_info"]["output_token_logprobs"], b["meta_info"]["output_token_logprobs"]
    ):
        assert abs(x - y) < 1e-5


def test_adapter_equals_merged_weights(lora_setup):
    lora, merged, adapter_dir, _ = lora_setup
    r = post(lora.url, "/load_lora_adapter", {"lora_name": "a1", "lora_path": str(adapter_dir)})
    assert r.status_code == 200 and r.json()["success"] and "a1" in r.json()["loaded_adapters"]
    with_adapter = post(lora.url, "/generate", {**BODY, "lora_path": "a1"}).json()
    reference = post(merged.url, "/generate", BODY).json()
    _same(with_adapter, reference)
    base = post(lora.url, "/generate", BODY).json()
    assert (
        base["output_ids"] != with_adapter["output_ids"]
        or base["meta_info"]["output_token_logprobs"]
        != with_adapter["meta_info"]["output_token_logprobs"]
    )


def test_mixed_batch_applies_each_adapter_to_its_own_rows(lora_setup):
    lora, merged, _, _ = lora_setup
    bodies = [{**BODY, "lora_path": "a1"}, BODY, {**BODY, "lora_path": "a1"}, BODY]
    with ThreadPoolExecutor(4) as pool:
        outs = [r.json() for r in pool.map(lambda b: post(lora.url, "/generate", b), bodies)]
    reference = post(merged.url, "/generate", BODY).json()
    base = post(lora.url, "/generate", BODY).json()
    for body, out in zip(bodies, outs):
        _same(out, reference if "lora_path" in body else base)


def test_load_from_tensors_payload(lora_setup):
    lora, merged, _, adapter = lora_setup
    payload = {
        "lora_name": "a2",
        "config_dict": _config(),
        "safetensors_b64": base64.b64encode(save(adapter)).decode(),
    }
    r = post(lora.url, "/load_lora_adapter_from_tensors", payload)
    assert r.json()["success"], r.text
    _same(
        post(lora.url, "/generate", {**BODY, "lora_path": "a2"}).json(),
        post(merged.url, "/generate", BODY).json(),
    )
    assert post(lora.url, "/unload_lora_adapter", {"lora_name": "a2"}).json()["success"]
    gone = post(lora.url, "/generate", {**BODY, "lora_path": "a2"})
    assert gone.status_code == 400 and "a2" in gone.text


@pytest.mark.parametrize(
    "name, edit, words",
    [
        ("a1", None, ["already"]),
        ("big", lambda c, t: c.update(r=16), ["r=16", "--max-lora-rank"]),
        (
            "onlyA",
            lambda c, t: [t.pop(k) for k in [k for k in t if "lora_B" in k]],
            ["needs both lora_A and lora_B"],
        ),
        (
            "ghost",
            lambda c, t: t.update(
                {
                    "base_model.model.model.layers.0.self_attn.nope.lora_A.weight": torch.zeros(
                        4, 64
                    ),
                    "base_model.model.model.layers.0.self_attn.nope.lora_B.weight": torch.zeros(
                        64, 4
                    ),
                }
            ),
            ["no linear layer", "nope"],
        ),
        (
            "k",
            lambda c, t: c.update(target_modules=TARGETS + ["k_proj"]),
            ["k_proj", "--lora-target-modules"],
        ),
        (
            "shape",
            lambda c, t: t.update({k: v[:, :-1].contiguous() for k, v in list(t.items())[:1]}),
            ["do not fit"],
        ),
    ],
)
def test_bad_adapters_are_refused_whole(lora_setup, name, edit, words):
    lora, _, _, adapter = lora_setup
    post(lora.url, "/load_lora_adapter", {"lora_name": "a1", "lora_path": str(lora_setup[2])})
    config, tensors = _config(), dict(adapter)
    if edit is not None:
        edit(config, tensors)
    payload = {
        "lora_name": name,
        "config_dict": config,
        "safetensors_b64": base64.b64encode(save(tensors)).decode(),
    }
    r = post(lora.url, "/load_lora_adapter_from_tensors", payload)
    assert r.status_code == 400 and not r.json()["success"]
    for word in words:
        assert word in r.json()["error_message"]
    assert name == "a1" or name not in r.json()["loaded_adapters"]


def test_lora_needs_enable_lora(ds_engine):
    r = post(ds_engine.url, "/load_lora_adapter", {"lora_name": "x", "lora_path": "/nowhere"})
    assert r.status_code == 400 and "--enable-lora" in r.json()["error_message"]
    assert "--enable-lora" in post(ds_engine.url, "/generate", {**BODY, "lora_path": "x"}).text


def test_payload_is_never_unpickled(lora_setup):
    lora = lora_setup[0]
    buf = io.BytesIO()
    torch.save({"x": torch.zeros(1)}, buf)  # a pickle, not safetensors
    payload = {
        "lora_name": "p",
        "config_dict": _config(),
        "safetensors_b64": base64.b64encode(buf.getvalue()).decode(),
    }
    r = post(lora.url, "/load_lora_adapter_from_tensors", payload)
    assert r.status_code == 400 and "safetensors" in r.json()["error_message"]
