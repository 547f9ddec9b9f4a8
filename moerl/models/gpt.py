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
from moerl.compat import megatron_patches
from moerl.config.parallel import ParallelConfig
from moerl.models.spec import decoder_block_spec

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def build_transformer_config(model: Any, parallel: ParallelConfig, dtype: str = "fp32") -> Any:
    """The megatron-core TransformerConfig for ``model`` (a ``ModelConfig``) under ``parallel``."""
    from megatron.core.transformer import TransformerConfig

    if dtype not in DTYPES:
        raise ValueError(f"trainer.dtype={dtype!r}: choose one of {sorted(DTYPES)}")
    params_dtype = DTYPES[dtype]
    num_experts = model.num_experts
    moe: dict[str, Any] = {}
    if num_experts:
        first_dense = getattr(model, "first_k_dense_replace", 0) or 0
        moe = dict(
            num_moe_experts=num_experts,
            moe_router_topk=model.moe_router_topk,
            moe_ffn_hidden_size=model.moe_ffn_hidden_size,
            moe_shared_expert_intermediate_size=model.moe_shared_expert_intermediate_size,
            moe_layer_freq=[0] * first_dense + [1] * (model.num_layers - first_dense),
            moe_token_dispatcher_type=getattr(model, "moe_token_dispatcher_type", "alltoall"),
            moe_router_load_balancing_type=getattr(
                model, "moe_router_load_balancing_type", "aux_loss"
            ),
            moe_aux_loss_coeff=getattr(model, "moe_aux_loss_coeff", 0.0),
            moe_grouped_gemm=False,
            moe_router_dtype="fp32",
            moe_permute_fusion=False,
            moe_router_fusion=False,
        )
    return TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        ffn_hidden_size=model.ffn_hidden_size,
        normalization=model.normalization,
        layernorm_epsilon=getattr(model, "norm_epsilon", 1e-6),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=getattr(model, "init_method_std", 0.02),
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
        **moe,
    )


def build_model(
    model: Any,
    parallel: ParallelConfig,
    dtype: str = "fp32",
    *,
    use_te: bool | None = None,
) -> list[torch.nn.Module]:
    """This rank's ``GPTModel`` chunks (one per virtual pipeline stage)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    compat.activate()
    megatron_patches.fix_missing_te()
    config = build_transformer_config(model, parallel, dtype)
    chunks: list[torch.nn.Module] = []
    for vp in range(parallel.virtual_pp or 1):
        vp_stage = vp if parallel.virtual_pp else None
        chunk = GPTModel(
            config=config,
            transformer_layer_spec=decoder_block_spec(config, vp_stage=vp_stage, use_te=use_te),
            vocab_size=model.vocab_size,
            max_sequence_length=model.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(
                ignore_virtual=False, vp_stage=vp_stage
            ),
            post_process=parallel_state.is_pipeline_last_stage(
                ignore_virtual=False, vp_stage=vp_stage
            ),
            share_embeddings_and_output_weights=getattr(model, "tie_word_embeddings", False),
            position_embedding_type="rope",
            rotary_base=getattr(model, "rope_theta", 10000),
            vp_stage=vp_stage,
        )
        chunks.append(chunk.to(device.device()))
    return chunks
