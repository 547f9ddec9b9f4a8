"""Model families: HF config ⇄ moerl ``ModelConfig``, the HF model class, the tensor map.

A family owns the translation of an HF ``config.json`` into megatron-core options
and back (``tools/make_tiny_model.py`` builds HF models from it). Conversion maps
live in ``moerl.convert.<family>``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from moerl.config.model import ModelConfig


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, yarn-style scaling or None) from transformers 4.x or 5.x fields."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or None
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    kind = (scaling or params).get("rope_type", (scaling or params).get("type", "default"))
    if kind in (None, "default"):
        return float(theta), None
    merged = {k: v for k, v in (scaling or params).items() if k not in ("rope_theta",)}
    merged["type"] = kind
    return float(theta), merged


def _require(cfg: dict[str, Any], family: str, model_types: tuple[str, ...]) -> None:
    got = cfg.get("model_type")
    if got not in model_types:
        raise ValueError(
            f"checkpoint config.json has model_type={got!r}, which is not the {family!r} family "
            f"(expects {' or '.join(model_types)}); choose the family that matches the checkpoint"
        )


def qwen3_moe_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    _require(cfg, "qwen3_moe", ("qwen3_moe",))
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
    theta, scaling = _rope(cfg)
    if scaling is not None:
        raise ValueError(f"qwen3_moe: rope scaling {scaling} is not supported yet")
    return ModelConfig(
        family="qwen3_moe",
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


def qwen3_moe_to_hf(m: ModelConfig) -> dict[str, Any]:
    return dict(
        model_type="qwen3_moe",
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


def deepseek_moe_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    _require(cfg, "deepseek_moe", ("deepseek_v3", "deepseek_v2"))
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
    theta, scaling = _rope(cfg)
    shared = cfg.get("n_shared_experts") or 0
    return ModelConfig(
        family="deepseek_moe",
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


def deepseek_moe_to_hf(m: ModelConfig) -> dict[str, Any]:
    shared = m.moe_shared_expert_intermediate_size or 0
    experts_ffn = m.moe_ffn_hidden_size or m.ffn_hidden_size
    if shared % experts_ffn:
        raise ValueError(
            "deepseek_moe: the shared-expert width must be a multiple of the expert width"
        )
    if m.moe_router_score_function != "sigmoid" or not m.moe_router_enable_expert_bias:
        raise ValueError("deepseek_moe HF export writes DeepSeek-V3 configs: sigmoid + expert bias")
    return dict(
        model_type="deepseek_v3",
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


@dataclass(frozen=True)
class Family:
    name: str
    from_hf: Callable[[dict[str, Any]], ModelConfig]
    to_hf: Callable[[ModelConfig], dict[str, Any]]
    hf_architecture: str  # transformers class name


FAMILIES: dict[str, Family] = {
    "qwen3_moe": Family("qwen3_moe", qwen3_moe_from_hf, qwen3_moe_to_hf, "Qwen3MoeForCausalLM"),
    "deepseek_moe": Family(
        "deepseek_moe", deepseek_moe_from_hf, deepseek_moe_to_hf, "DeepseekV3ForCausalLM"
    ),
}


def get_family(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"model.family={name!r}: choose one of {sorted(FAMILIES)}")
    return FAMILIES[name]
