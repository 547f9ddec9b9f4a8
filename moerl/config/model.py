"""Model shape: the sizes a megatron-core TransformerConfig is built from.

Kept minimal on purpose; families add their own fields (MLA, group-limited routing)
when they need them. Names follow megatron-core's TransformerConfig where one exists.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ModelConfig:
    """Architecture of the policy model (the trainer's GPTModel and the engines' copy)."""

    family: str = "gpt"
    """Model family key in `moerl.models`, which picks the layer spec and the HF name map
    (e.g. 'gpt' for plain megatron layers, later 'deepseek_v3' or 'qwen3_moe')."""
    num_layers: int = 2
    """Number of transformer layers."""
    hidden_size: int = 64
    """Width of the residual stream."""
    num_attention_heads: int = 4
    """Attention (query) heads per layer."""
    num_query_groups: int | None = None
    """Key/value head groups for grouped-query attention; None = one per head (MHA)."""
    ffn_hidden_size: int = 128
    """Hidden width of the dense MLP (dense layers, and the whole model when num_experts is None)."""
    vocab_size: int = 128
    """Vocabulary size (the embedding and output layer are padded by megatron-core as needed)."""
    max_position_embeddings: int = 32
    """Longest position the rotary embedding is built for; at least seq_length."""
    num_experts: int | None = None
    """Routed experts per MoE layer; None = a dense model."""
    moe_router_topk: int = 2
    """Experts each token is routed to (K)."""
    moe_ffn_hidden_size: int | None = None
    """Hidden width of each routed expert's MLP; None = ffn_hidden_size."""
    moe_shared_expert_intermediate_size: int | None = None
    """Hidden width of the always-on shared expert(s); None = no shared expert."""
    normalization: str = "RMSNorm"
    """Norm layer: 'RMSNorm' or 'LayerNorm'."""
    seq_length: int = 32
    """Longest packed training sequence (prompt + response) in tokens."""

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None
