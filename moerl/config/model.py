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
    path: str | None = None
    """A local Hugging Face checkpoint to start from (trainer and engines); its config.json
    then defines the architecture. None = random weights from this config (tiny models),
    written into the run directory. Nothing is downloaded."""
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
    kv_channels: int | None = None
    """Per-head dimension of (GQA) attention; None = hidden_size / num_attention_heads."""
    qk_layernorm: bool = False
    """RMSNorm over each query/key head before RoPE (Qwen3)."""
    norm_epsilon: float = 1e-6
    """Epsilon of every norm layer."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    tie_word_embeddings: bool = False
    """Share the input embedding with the output layer."""
    init_method_std: float = 0.02
    """Std of the normal initialisation (random-init models only)."""

    # --- MoE routing -------------------------------------------------------------
    first_k_dense_replace: int = 0
    """The first k layers are dense MLPs, the rest MoE (DeepSeek)."""
    moe_router_score_function: str = "softmax"
    """Router score: 'softmax' (Qwen3, DeepSeek-V2) or 'sigmoid' (DeepSeek-V3)."""
    moe_router_pre_softmax: bool = False
    """Softmax over all experts before top-k without renormalising the top-k
    (HF norm_topk_prob=False); False = top-k weights sum to one."""
    moe_router_num_groups: int | None = None
    """Expert groups for group-limited routing (HF n_group); None = no groups."""
    moe_router_group_topk: int | None = None
    """Groups each token may route into (HF topk_group)."""
    moe_router_topk_scaling_factor: float | None = None
    """Multiplier on the routing weights (HF routed_scaling_factor)."""
    moe_router_enable_expert_bias: bool = False
    """Aux-loss-free balancing: a per-expert bias added for selection only
    (HF e_score_correction_bias)."""
    moe_router_load_balancing_type: str = "aux_loss"
    """'aux_loss', 'seq_aux_loss' or 'none'."""
    moe_aux_loss_coeff: float = 0.0
    """Weight of the load-balancing loss (0 disables it)."""
    moe_token_dispatcher_type: str = "alltoall"
    """megatron-core token dispatcher: 'alltoall' or 'allgather'."""

    # --- multi-latent attention (DeepSeek) ---------------------------------------
    multi_latent_attention: bool = False
    """Use MLA instead of GQA."""
    q_lora_rank: int | None = None
    """Rank of the query down-projection; None = a full query projection (V2-Lite)."""
    kv_lora_rank: int = 512
    """Rank of the compressed key/value latent."""
    qk_head_dim: int = 128
    """Per-head query/key dimension without RoPE (HF qk_nope_head_dim)."""
    qk_pos_emb_head_dim: int = 64
    """Per-head query/key dimension with RoPE (HF qk_rope_head_dim)."""
    v_head_dim: int = 128
    """Per-head value dimension."""
    rope_scaling: dict | None = None
    """HF-style YaRN settings (type, factor, original_max_position_embeddings,
    beta_fast, beta_slow, mscale, mscale_all_dim); None = plain RoPE."""

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None
