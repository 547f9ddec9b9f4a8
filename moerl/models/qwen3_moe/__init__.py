"""The Qwen3-MoE family (``model_type: qwen3_moe``; Qwen3-30B-A3B, Qwen3-235B-A22B)."""

from __future__ import annotations

import functools

from moerl.models.qwen3_moe import config, weights
from moerl.models.registry import ModelFamily, register_family
from moerl.models.tiny import model_config

QWEN3_MOE = register_family(
    ModelFamily(
        name="qwen3_moe",
        hf_model_types=("qwen3_moe",),
        hf_architecture="Qwen3MoeForCausalLM",
        config_from_hf=config.from_hf,
        config_to_hf=config.to_hf,
        weight_map=weights.weight_map,
        tiny=functools.partial(model_config, "qwen3_moe_tiny"),
    )
)
