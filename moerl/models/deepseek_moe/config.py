"""DeepSeek-V2/V3 config.json ⇄ ``ModelConfig`` (MLA, shared experts, group-limited
sigmoid routing with an expert bias; Moonlight is a DeepSeek-V3 config)."""

from __future__ import annotations

from typing import Any

from moerl.config.model import ModelConfig
from moerl.models.hf_common import rope_from_hf


def from_hf(cfg: dict[str, Any]) -> ModelConfig:
    if cfg.get("attention_bias"):
        raise ValueError("deepseek_moe: attention_bias=True is not supported")
    v3 = cfg["model_type"] == "deepseek_v3"
    scoring = cfg.get("scoring_func", "sigmoid" if v3 else "softmax")
    topk_method = cfg.get("topk_method", "noaux_tc" if v3 else "greedy")
    # One expert group (Moonlight) makes group-limited routing a no-op.
    grouped = topk_method in ("noaux_tc", "group_limited_greedy") and cfg.get("n_group", 1) > 1
    if grouped and cfg["num_experts_per_tok"] // cfg.get("topk_group", 1) != 2:
        # HF scores a group by the sum of its top-2 experts; megatron-core by its top
        # (topk // topk_group). They agree only when that ratio is 2 (as in DeepSeek-V3).
        raise ValueError(
            f"deepseek_moe: num_experts_per_tok={cfg['num_experts_per_tok']} // topk_group="
            f"{cfg.get('topk_group')} must be 2 for megatron-core's group scores to match HF's"
        )
    theta, scaling = rope_from_hf(cfg)
    shared = cfg.get("n_shared_experts") or 0
    return ModelConfig(
        num_layers=cfg["num_hidden_layers"],
        hidden_size=cfg["hidden_size"],
        num_attention_heads=cfg["num_attention_heads"],
        ffn_hidden_size=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        max_position_embeddings=cfg["max_position_embeddings"],
        num_experts=cfg["n_routed_experts"],
        moe_router_topk=cfg["num_experts_per_tok"],
        moe_ffn_hidden_size=cfg["moe_intermediate_size"],
        moe_shared_expert_intermediate_size=shared * cfg["moe_intermediate_size"] or None,
        first_k_dense_replace=cfg.get("first_k_dense_replace", 0),
        moe_router_score_function=scoring,
        moe_router_pre_softmax=scoring == "softmax" and not cfg.get("norm_topk_prob", False),
        moe_router_num_groups=cfg.get("n_group") if grouped else None,
        moe_router_group_topk=cfg.get("topk_group") if grouped else None,
        moe_router_topk_scaling_factor=cfg.get("routed_scaling_factor"),
        moe_router_enable_expert_bias=topk_method == "noaux_tc",
        moe_router_load_balancing_type="seq_aux_loss" if v3 else "aux_loss",
        multi_latent_attention=True,
        qk_layernorm=True,
        q_lora_rank=cfg.get("q_lora_rank"),
        kv_lora_rank=cfg["kv_lora_rank"],
        qk_head_dim=cfg["qk_nope_head_dim"],
        qk_pos_emb_head_dim=cfg["qk_rope_head_dim"],
        v_head_dim=cfg["v_head_dim"],
        norm_epsilon=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
    )


def to_hf(m: ModelConfig) -> dict[str, Any]:
    """DeepSeek-V3 config fields (the family's first model type)."""
    shared = m.moe_shared_expert_intermediate_size or 0
    experts_ffn = m.moe_ffn_hidden_size or m.ffn_hidden_size
    if shared % experts_ffn:
        raise ValueError(
            "deepseek_moe: the shared-expert width must be a multiple of the expert width"
        )
    if m.moe_router_score_function != "sigmoid" or not m.moe_router_enable_expert_bias:
        raise ValueError("deepseek_moe HF export writes DeepSeek-V3 configs: sigmoid + expert bias")
    return dict(
        vocab_size=m.vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=m.ffn_hidden_size,
        moe_intermediate_size=experts_ffn,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_attention_heads,
        n_shared_experts=shared // experts_ffn,
        n_routed_experts=m.num_experts,
        routed_scaling_factor=m.moe_router_topk_scaling_factor or 1.0,
        kv_lora_rank=m.kv_lora_rank,
        q_lora_rank=m.q_lora_rank,
        qk_rope_head_dim=m.qk_pos_emb_head_dim,
        qk_nope_head_dim=m.qk_head_dim,
        v_head_dim=m.v_head_dim,
        n_group=m.moe_router_num_groups or 1,
        topk_group=m.moe_router_group_topk or 1,
        num_experts_per_tok=m.moe_router_topk,
        first_k_dense_replace=m.first_k_dense_replace,
        norm_topk_prob=True,
        rms_norm_eps=m.norm_epsilon,
        rope_theta=m.rope_theta,
        rope_scaling=m.rope_scaling,
        rope_interleave=True,
        max_position_embeddings=m.max_position_embeddings,
        tie_word_embeddings=m.tie_word_embeddings,
        attention_bias=False,
    )
