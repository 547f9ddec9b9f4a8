"""A model family defined outside moerl, as a user would: no file under moerl/ changes.

``toy_moe`` is Qwen3-MoE's architecture under its own Hugging Face ``model_type``,
registered with transformers (so ``AutoModelForCausalLM`` reads its checkpoints) and with
moerl, with a tiny shape of its own (every layer MoE, 4 experts). Tests select it by
name (``toy_moe``, once this module is imported) or by import path
(``families_for_tests.TOY_MOE``, which spawned ranks import themselves). ``tests/`` is on
``sys.path`` through its conftest.
"""

from __future__ import annotations

import dataclasses

from transformers import AutoConfig, AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from moerl.config.model import ModelConfig
from moerl.models import ModelFamily, get_family, register_family

PATH = f"{__name__}.TOY_MOE"


class ToyMoeConfig(Qwen3MoeConfig):
    model_type = "toy_moe"


class ToyMoeForCausalLM(Qwen3MoeForCausalLM):
    config_class = ToyMoeConfig


AutoConfig.register("toy_moe", ToyMoeConfig)
AutoModelForCausalLM.register(ToyMoeConfig, ToyMoeForCausalLM)
try:  # transformers 5 fuses experts in memory and splits them on save, per model_type
    from transformers.conversion_mapping import (
        get_checkpoint_conversion_mapping,
        register_checkpoint_conversion_mapping,
    )
except ImportError:  # transformers 4 keeps one module per expert
    pass
else:
    register_checkpoint_conversion_mapping(
        "toy_moe", get_checkpoint_conversion_mapping("qwen3_moe")
    )

_qwen = get_family("qwen3_moe")


def _tiny() -> ModelConfig:
    return dataclasses.replace(
        _qwen.tiny_config(), num_layers=3, num_experts=4, first_k_dense_replace=0
    )


TOY_MOE = register_family(
    ModelFamily(
        name="toy_moe",
        hf_model_types=("toy_moe",),
        hf_architecture=f"{__name__}.ToyMoeForCausalLM",
        config_from_hf=_qwen.config_from_hf,
        config_to_hf=_qwen.config_to_hf,
        weight_map=_qwen.weight_map,
        tiny=_tiny,
    )
)
