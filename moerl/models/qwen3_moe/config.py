"""Qwen3-MoE config.json ⇄ ``ModelConfig`` (GQA with q/k norm, leading dense layers)."""

from __future__ import annotations

from typing import Any

from moerl.config.model import ModelConfig
from moerl.models.hf_common import rope_from_hf


def from_hf(cfg: dict[str, Any]) -> ModelConfig:
    step = cfg.get("decoder_sparse_step", 1)
    mlp_only = cfg.get("mlp_only_layers") or []
    layers = cfg["num_hidden_layers"]
    moe_layers = [i for i in range(layers) if i not in mlp_only and (i + 1) % step == 0]
    dense_first = layers - len(moe_layers)
    if moe_layers != list(range(dense_first, layers)):
        raise ValueError(
            f"qwen3_moe: MoE layers {moe_layers} are not a suffix of the {layers} layers "
            "(decoder_sparse_step / mlp_only_layers); only leading dense layers are supported"
        )
    theta, scaling = rope_from_hf(cfg)
    if scaling is not None:
        raise ValueError(f"qwen3_moe: rope scaling {scaling} is not supported yet")
    return ModelConfig(
        num_layers=layers,
        hidden_size=cfg["hidden_size"],
        num_attention_heads=cfg["num_attention_heads"],
        num_query_groups=cfg["num_key_value_heads"],
        kv_channels=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        ffn_hidden_size=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        max_position_embeddings=cfg["max_position_embeddings"],
        num_experts=cfg.get("num_experts", cfg.get("num_local_experts")),
        moe_router_topk=cfg["num_experts_per_tok"],
        moe_ffn_hidden_size=cfg["moe_intermediate_size"],
        first_k_dense_replace=dense_first,
        moe_router_pre_softmax=not cfg.get("norm_topk_prob", True),
        qk_layernorm=True,
        norm_epsilon=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        moe_aux_loss_coeff=cfg.get("router_aux_loss_coef", 0.0),
    )


def to_hf(m: ModelConfig) -> dict[str, Any]:
    return dict(
        vocab_size=m.vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=m.ffn_hidden_size,
        moe_intermediate_size=m.moe_ffn_hidden_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_query_groups or m.num_attention_heads,
        head_dim=m.kv_channels or m.hidden_size // m.num_attention_heads,
        num_experts=m.num_experts,
        num_experts_per_tok=m.moe_router_topk,
        norm_topk_prob=not m.moe_router_pre_softmax,
        decoder_sparse_step=1,
        mlp_only_layers=list(range(m.first_k_dense_replace)),
        rms_norm_eps=m.norm_epsilon,
        rope_theta=m.rope_theta,
        max_position_embeddings=m.max_position_embeddings,
        tie_word_embeddings=m.tie_word_embeddings,
        router_aux_loss_coef=m.moe_aux_loss_coeff,
        attention_bias=False,
    )
