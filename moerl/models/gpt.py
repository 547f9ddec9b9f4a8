"""Build megatron-core ``GPTModel`` chunks from a moerl model config and layout.

``build_transformer_config`` maps moerl's ``ModelConfig`` fields onto
megatron-core's ``TransformerConfig``; ``build_model`` returns this rank's model
chunks (one per virtual pipeline stage) for the current parallel state.
Model families (DeepSeek MLA, Qwen3 q/k-norm, ...) extend the config mapping.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from moerl import compat, device
from moerl.common.checks import one_of
from moerl.compat import megatron_patches
from moerl.config.parallel import ParallelConfig
from moerl.models.spec import decoder_block_spec

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _moe_kwargs(model: Any) -> dict[str, Any]:
    if not model.num_experts:
        return {}
    dense = model.first_k_dense_replace
    if not 0 <= dense < model.num_layers:
        raise ValueError(
            f"model.first_k_dense_replace={dense} must be in [0, num_layers={model.num_layers})"
        )
    return dict(
        num_moe_experts=model.num_experts,
        moe_router_topk=model.moe_router_topk,
        moe_ffn_hidden_size=model.moe_ffn_hidden_size or model.ffn_hidden_size,
        moe_shared_expert_intermediate_size=model.moe_shared_expert_intermediate_size,
        moe_layer_freq=[0] * dense + [1] * (model.num_layers - dense),
        moe_token_dispatcher_type=model.moe_token_dispatcher_type,
        moe_router_load_balancing_type=model.moe_router_load_balancing_type,
        moe_aux_loss_coeff=model.moe_aux_loss_coeff,
        moe_router_score_function=model.moe_router_score_function,
        moe_router_pre_softmax=model.moe_router_pre_softmax,
        moe_router_num_groups=model.moe_router_num_groups,
        moe_router_group_topk=model.moe_router_group_topk,
        moe_router_topk_scaling_factor=model.moe_router_topk_scaling_factor,
        moe_router_enable_expert_bias=model.moe_router_enable_expert_bias,
        moe_grouped_gemm=False,
        moe_router_dtype="fp32",
        moe_permute_fusion=False,
        # Keep Routing needs the unfused router (the fused path skips RouterReplay).
        moe_router_fusion=False,
    )


def _mla_kwargs(model: Any) -> dict[str, Any]:
    scaling = dict(model.rope_scaling or {})
    kind = scaling.get("type", scaling.get("rope_type", "rope"))
    if kind not in ("rope", "default", "yarn"):
        raise ValueError(f"model.rope_scaling.type={kind!r}: MLA supports 'yarn' or none")
    out: dict[str, Any] = dict(
        q_lora_rank=model.q_lora_rank,
        kv_lora_rank=model.kv_lora_rank,
        qk_head_dim=model.qk_head_dim,
        qk_pos_emb_head_dim=model.qk_pos_emb_head_dim,
        v_head_dim=model.v_head_dim,
        rotary_base=model.rope_theta,
        rope_type="yarn" if kind == "yarn" else "rope",
    )
    if kind == "yarn":
        out.update(
            rotary_scaling_factor=scaling["factor"],
            original_max_position_embeddings=scaling["original_max_position_embeddings"],
            beta_fast=scaling.get("beta_fast", 32),
            beta_slow=scaling.get("beta_slow", 1),
            mscale=scaling.get("mscale", 1.0),
            mscale_all_dim=scaling.get("mscale_all_dim", 0.0),
        )
    return out


RECOMPUTE = ("none", "full", "moe")


def recompute_kwargs(recompute: str) -> dict[str, Any]:
    """Activation recompute: 'full' recomputes every transformer layer in backward,
    'moe' only the MoE layers (megatron's selective recompute of module "moe")."""
    one_of("trainer.recompute", recompute, RECOMPUTE)
    if recompute == "full":
        return dict(
            recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
        )
    if recompute == "moe":
        return dict(recompute_granularity="selective", recompute_modules=["moe"])
    return {}


def build_transformer_config(
    model: Any,
    parallel: ParallelConfig,
    dtype: str = "fp32",
    *,
    routing_replay: bool = False,
    per_token_loss: bool = False,
    recompute: str = "none",
) -> Any:
    """The megatron-core (MLA)TransformerConfig for ``model`` (a ``ModelConfig``) under ``parallel``."""
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    one_of("trainer.dtype", dtype, sorted(DTYPES))
    params_dtype = DTYPES[dtype]
    cls = TransformerConfig
    extra = _moe_kwargs(model)
    if routing_replay and extra:
        extra["moe_enable_routing_replay"] = True
    if model.multi_latent_attention:
        cls = MLATransformerConfig
        extra.update(_mla_kwargs(model))
    extra.update(recompute_kwargs(recompute))
    return cls(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.kv_channels,
        ffn_hidden_size=model.ffn_hidden_size,
        normalization=model.normalization,
        layernorm_epsilon=model.norm_epsilon,
        qk_layernorm=model.qk_layernorm,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=model.init_method_std,
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=parallel.virtual_pp,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.expert_tp,
        sequence_parallel=parallel.use_sequence_parallel(),
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=dtype == "bf16",
        fp16=dtype == "fp16",
        use_cpu_initialization=not device.has_cuda(),
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        cross_entropy_loss_fusion=False,
        # the RL step normalises by tokens/sequences of the whole global batch; DDP reads
        # this when it is built to decide its gradient scaling
        calculate_per_token_loss=per_token_loss,
        **extra,
    )


def build_model(
    model: Any,
    parallel: ParallelConfig,
    dtype: str = "fp32",
    *,
    use_te: bool | None = None,
    routing_replay: bool = False,
    per_token_loss: bool = False,
    recompute: str = "none",
    expert_gemm: str = "auto",
) -> list[torch.nn.Module]:
    """This rank's ``GPTModel`` chunks (one per virtual pipeline stage). ``expert_gemm``:
    trainer.expert_gemm (``moerl.models.grouped_experts.use_grouped``)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    compat.activate()
    megatron_patches.fix_missing_te()
    megatron_patches.fix_expert_bias_padding_mask()
    config = build_transformer_config(
        model, parallel, dtype, routing_replay=routing_replay, per_token_loss=per_token_loss,
        recompute=recompute,
    )  # fmt: skip
    from moerl.models.grouped_experts import use_grouped

    grouped = use_grouped(expert_gemm, device.has_cuda())
    chunks: list[torch.nn.Module] = []
    for vp in range(parallel.virtual_pp or 1):
        vp_stage = vp if parallel.virtual_pp else None
        chunk = GPTModel(
            config=config,
            transformer_layer_spec=decoder_block_spec(
                config, vp_stage=vp_stage, use_te=use_te, grouped_experts=grouped
            ),
            vocab_size=model.vocab_size,
            max_sequence_length=model.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(
                ignore_virtual=False, vp_stage=vp_stage
            ),
            post_process=parallel_state.is_pipeline_last_stage(
                ignore_virtual=False, vp_stage=vp_stage
            ),
            share_embeddings_and_output_weights=model.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=model.rope_theta,
            vp_stage=vp_stage,
        )
        chunks.append(chunk.to(device.device()))
    return chunks
