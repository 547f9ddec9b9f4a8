"""The HF ⇄ Megatron tensor maps of each model family (see ``maps.py``)."""

from __future__ import annotations

from moerl.config.model import ModelConfig
from moerl.convert.maps import QKV, Concat, Copy, Entry, FamilyMap

GLOBALS = [
    Entry(("embedding.word_embeddings.weight",), Copy("model.embed_tokens.weight")),
    Entry(("decoder.final_layernorm.weight",), Copy("model.norm.weight")),
]
OUTPUT = Entry(("output_layer.weight",), Copy("lm_head.weight"))

# megatron-core names a layer's norms after the linear they precede when the local
# spec is used for GQA; MLA layers keep the module names. Both spellings map.
INPUT_NORM = ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight")
PRE_MLP_NORM = ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight")


def _mlp(prefix: str, megatron: str) -> list[Entry]:
    return [
        Entry(
            (f"{megatron}.linear_fc1.weight",),
            Concat((f"{prefix}.gate_proj.weight", f"{prefix}.up_proj.weight")),
        ),
        Entry((f"{megatron}.linear_fc2.weight",), Copy(f"{prefix}.down_proj.weight")),
    ]


def _experts() -> list[Entry]:
    prefix = "mlp.experts.{expert}"
    return [
        Entry(
            ("mlp.experts.experts.linear_fc1.weight",),
            Concat((f"{prefix}.gate_proj.weight", f"{prefix}.up_proj.weight")),
            expert=True,
        ),
        Entry(
            ("mlp.experts.experts.linear_fc2.weight",),
            Copy(f"{prefix}.down_proj.weight"),
            expert=True,
        ),
    ]


def _globals(m: ModelConfig) -> list[Entry]:
    return GLOBALS + ([] if m.tie_word_embeddings else [OUTPUT])


def qwen3_moe_map(m: ModelConfig) -> FamilyMap:
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
    moe = attention + [Entry(("mlp.router.weight",), Copy("mlp.gate.weight"))] + _experts()
    return FamilyMap(
        globals=_globals(m),
        dense_layer=attention + _mlp("mlp", "mlp"),
        moe_layer=moe,
        first_moe_layer=m.first_k_dense_replace,
        num_layers=m.num_layers,
    )


def deepseek_moe_map(m: ModelConfig) -> FamilyMap:
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
    moe = attention + [Entry(("mlp.router.weight",), Copy("mlp.gate.weight"))] + _experts()
    if m.moe_router_enable_expert_bias:
        moe.append(Entry(("mlp.router.expert_bias",), Copy("mlp.gate.e_score_correction_bias")))
    if m.moe_shared_expert_intermediate_size:
        moe += _mlp("mlp.shared_experts", "mlp.shared_experts")
    return FamilyMap(
        globals=_globals(m),
        dense_layer=attention + _mlp("mlp", "mlp"),
        moe_layer=moe,
        first_moe_layer=m.first_k_dense_replace,
        num_layers=m.num_layers,
    )


MAPS = {"qwen3_moe": qwen3_moe_map, "deepseek_moe": deepseek_moe_map}


def family_map(m: ModelConfig) -> FamilyMap:
    if m.family not in MAPS:
        raise ValueError(f"model.family={m.family!r} has no HF map; choose one of {sorted(MAPS)}")
    return MAPS[m.family](m)
