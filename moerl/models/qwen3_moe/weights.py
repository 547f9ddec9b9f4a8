"""Qwen3-MoE HF ⇄ Megatron tensor map (see ``moerl.models.maps``)."""

from __future__ import annotations

from moerl.config.model import ModelConfig
from moerl.models.hf_common import (
    INPUT_NORM,
    PRE_MLP_NORM,
    expert_entries,
    global_entries,
    mlp_entries,
)
from moerl.models.maps import QKV, Copy, Entry, FamilyMap


def weight_map(m: ModelConfig) -> FamilyMap:
    head_dim = m.kv_channels or m.hidden_size // m.num_attention_heads
    attention = [
        Entry(INPUT_NORM, Copy("input_layernorm.weight")),
        Entry(
            ("self_attention.linear_qkv.weight",),
            QKV(
                ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
                heads=m.num_attention_heads,
                groups=m.num_query_groups or m.num_attention_heads,
                head_dim=head_dim,
            ),
        ),
        Entry(("self_attention.linear_proj.weight",), Copy("self_attn.o_proj.weight")),
        Entry(("self_attention.q_layernorm.weight",), Copy("self_attn.q_norm.weight")),
        Entry(("self_attention.k_layernorm.weight",), Copy("self_attn.k_norm.weight")),
        Entry(PRE_MLP_NORM, Copy("post_attention_layernorm.weight")),
    ]
    router = [Entry(("mlp.router.weight",), Copy("mlp.gate.weight"))]
    return FamilyMap(
        globals=global_entries(m),
        dense_layer=attention + mlp_entries("mlp", "mlp"),
        moe_layer=attention + router + expert_entries(),
        first_moe_layer=m.first_k_dense_replace,
        num_layers=m.num_layers,
    )
