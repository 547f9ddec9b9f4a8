"""LoRA config, target names, PEFT files and the merge, against hand-computed values."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from moerl.config.lora import LoraConfig
from moerl.lora import (
    adapter_pairs,
    load_peft,
    merged_hf_state,
    peft_config,
    resolve_targets,
    save_peft,
)
from moerl.models.tiny import tiny_config

A = "base_model.model.model.layers.0.mlp.experts.1.up_proj.lora_A.weight"
B = "base_model.model.model.layers.0.mlp.experts.1.up_proj.lora_B.weight"


@pytest.mark.parametrize(
    "field, value, words",
    [("rank", 0, "lora.rank=0"), ("alpha", 0.0, "lora.alpha"), ("dropout", 1.0, "lora.dropout")],
)
def test_config_rejects_bad_values(field, value, words):
    with pytest.raises(ValueError, match=words):
        LoraConfig(**{field: value}).validate()


def test_targets_resolve_per_family():
    ds, qw = tiny_config("deepseek_moe"), tiny_config("qwen3_moe")
    assert "kv_b_proj" in resolve_targets(LoraConfig(), ds)
    assert "q_proj" not in resolve_targets(LoraConfig(), ds)  # q_lora_rank: q_a/q_b instead
    assert resolve_targets(LoraConfig(target_modules=["up_proj", "gate_proj"]), qw) == [
        "gate_proj",
        "up_proj",
    ]
    with pytest.raises(ValueError, match="kv_b_proj"):
        resolve_targets(LoraConfig(target_modules=["kv_b_proj"]), qw)

    # the output layer is named apart ('all-linear' excludes it, as in PEFT)
    assert "lm_head" not in resolve_targets(LoraConfig(), qw)
    both = resolve_targets(LoraConfig(target_modules=["all-linear", "lm_head"]), qw)
    assert both == sorted([*resolve_targets(LoraConfig(), qw), "lm_head"])
    tied = dataclasses.replace(qw, tie_word_embeddings=True)
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        resolve_targets(LoraConfig(target_modules=["lm_head"]), tied)


def test_peft_config_and_files(tmp_path):
    cfg = LoraConfig(enabled=True, rank=2, alpha=6.0, target_modules=["up_proj"])
    config = peft_config(cfg, tiny_config("qwen3_moe"), base_model_name_or_path="tiny")
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (2, 6.0, ["up_proj"])
    tensors = {A: torch.randn(2, 5), B: torch.randn(3, 2)}
    save_peft(tmp_path, tensors, config)
    assert json.loads((tmp_path / "adapter_config.json").read_text()) == config
    back, back_config = load_peft(tmp_path)
    assert back_config == config and all(torch.equal(back[n], t) for n, t in tensors.items())
    with pytest.raises(ValueError, match="not a PEFT adapter directory"):
        load_peft(tmp_path / "nothing")
    with pytest.raises(ValueError, match="not PEFT LoRA tensor names"):
        save_peft(tmp_path / "bad", {"model.layers.0.weight": torch.zeros(1)}, config)


def test_merge_is_w_plus_scaled_ba():
    a = torch.tensor([[1.0, 0.0, 2.0], [0.0, 1.0, 0.0]])  # [r=2, in=3]
    b = torch.tensor([[1.0, 1.0], [0.0, 2.0]])  # [out=2, r=2]
    w = torch.ones(2, 3)
    key = "model.layers.0.mlp.experts.1.up_proj.weight"
    other = torch.zeros(4)
    merged = merged_hf_state(
        {key: w, "model.norm.weight": other}, {A: a, B: b}, {"r": 2, "lora_alpha": 1.0}
    )
    # scaling 0.5; B @ A = [[1, 1, 2], [0, 2, 0]]
    assert torch.equal(merged[key], torch.tensor([[1.5, 1.5, 2.0], [1.0, 2.0, 1.0]]))
    assert merged["model.norm.weight"] is other
    with pytest.raises(KeyError, match="no weight"):
        merged_hf_state({}, {A: a, B: b}, {"r": 2})
    with pytest.raises(ValueError, match="does not fit"):
        merged_hf_state({key: torch.ones(3, 3)}, {A: a, B: b}, {"r": 2})
    with pytest.raises(ValueError, match="only one of"):
        adapter_pairs({A: a})
