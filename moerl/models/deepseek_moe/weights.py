"""DeepSeek-V2/V3 HF ⇄ Megatron tensor map (see ``moerl.models.maps``)."""

from __future__ import annotations

from moerl.config.model import ModelConfig
from moerl.models.hf_common import (
    INPUT_NORM,
    PRE_MLP_NORM,
    expert_entries,
    global_entries,
    mlp_entries,
)
from moerl.models.maps import Copy, Entry, FamilyMap


def weight_map(m: ModelConfig) -> FamilyMap:
    attention = [
        Entry(INPUT_NORM, Copy("input_layernorm.weight")),
        Entry(("self_attention.linear_proj.weight",), Copy("self_attn.o_proj.weight")),
        Entry(
            ("self_attention.linear_kv_down_proj.weight",),
            Copy("self_attn.kv_a_proj_with_mqa.weight"),
        ),
        Entry(
            (
                "self_attention.kv_layernorm.weight",
                "self_attention.linear_kv_up_proj.layer_norm_weight",
            ),
            Copy("self_attn.kv_a_layernorm.weight"),
        ),
        Entry(("self_attention.linear_kv_up_proj.weight",), Copy("self_attn.kv_b_proj.weight")),
        Entry(PRE_MLP_NORM, Copy("post_attention_layernorm.weight")),
    ]
    if m.q_lora_rank is None:
        attention.append(
            Entry(("self_attention.linear_q_proj.weight",), Copy("self_attn.q_proj.weight"))
        )
    else:
        attention += [
            Entry(("self_attention.linear_q_down_proj.weight",), Copy("self_attn.q_a_proj.weight")),
            Entry(
                (
                    "self_attention.q_layernorm.weight",
                    "self_attention.linear_q_up_proj.layer_norm_weight",
                ),
                Copy("self_attn.q_a_layernorm.weight"),
            ),
            Entry(("self_attention.linear_q_up_proj.weight",), Copy("self_attn.q_b_proj.weight")),
        ]
    moe = attention + [Entry(("mlp.router.weight",), Copy("mlp.gate.weight"))] + expert_entries()
    if m.moe_router_enable_expert_bias:
        moe.append(Entry(("mlp.router.expert_bias",), Copy("mlp.gate.e_score_correction_bias")))
    if m.moe_shared_expert_intermediate_size:
        moe += mlp_entries("mlp.shared_experts", "mlp.shared_experts")
    return FamilyMap(
        globals=global_entries(m),
        dense_layer=attention + mlp_entries("mlp", "mlp"),
        moe_layer=moe,
        first_moe_layer=m.first_k_dense_replace,
        num_layers=m.num_layers,
    )
