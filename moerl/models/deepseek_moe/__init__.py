"""The DeepSeek-MoE family (``model_type: deepseek_v3`` or ``deepseek_v2``; DeepSeek-V3,
DeepSeek-V2-Lite, Moonlight). Exports write DeepSeek-V3 configs."""

from __future__ import annotations

import functools

from moerl.models.deepseek_moe import config, weights
from moerl.models.registry import ModelFamily, register_family
from moerl.models.tiny import model_config

DEEPSEEK_MOE = register_family(
    ModelFamily(
        name="deepseek_moe",
        hf_model_types=("deepseek_v3", "deepseek_v2"),
        hf_architecture="DeepseekV3ForCausalLM",
        config_from_hf=config.from_hf,
        config_to_hf=config.to_hf,
        weight_map=weights.weight_map,
        tiny=functools.partial(model_config, "deepseek_moe_tiny"),
    )
)
