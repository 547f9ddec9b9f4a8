"""Core attention without transformer-engine, for every local spec.

megatron-core's local ``DotProductAttention`` materialises the [b·n, s, s] scores, masks
them in place and keeps the softmax for backward: memory and time quadratic in s with a
large constant (tools/bench/scaling.py measured 5.6 s and 380 MB for a step on two
2K-token sequences of a 0.6M-parameter model). Its ``MLASelfAttention`` also needs
separate key and value head sizes (``k_channels``, ``v_channels``) and its own softmax
scale (YaRN ``mscale``), which only TE's attention accepts. This module is the local
(non-TE) stand-in for both: causal scaled-dot-product attention over ``[s, b, heads,
dim]`` tensors via ``torch.nn.functional.scaled_dot_product_attention`` (a fused,
memory-linear kernel without an explicit mask), with grouped-query attention's kv heads
shared by their query heads inside the kernel.
"""

# s sequence, b batch, n query heads on this TP rank, g kv heads, dk / dv key and value
# head dims

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule


class LocalCoreAttention(MegatronModule):
    """Causal SDPA, GQA and distinct key/value head dims (see module docstring)."""

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str = "self",
        softmax_scale: float | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(config=config)
        if config.context_parallel_size > 1:
            raise ValueError("context parallelism needs transformer-engine")
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale
        self.k_channels = k_channels
        self.v_channels = v_channels
        # the attention function (trainer.numerics=batch_invariant swaps in its own)
        self.sdpa = F.scaled_dot_product_attention

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if packed_seq_params is not None:
            raise NotImplementedError("packed (THD) sequences with local MLA attention")
        mask_type = attn_mask_type or self.attn_mask_type
        q_bnsd = query.permute(1, 2, 0, 3)
        k_bnsd = key.permute(1, 2, 0, 3)
        v_bnsd = value.permute(1, 2, 0, 3)
        mask = None
        causal = mask_type == AttnMaskType.causal and attention_mask is None
        if attention_mask is not None:
            # megatron-core masks are True where attention is *not* allowed.
            mask = ~attention_mask.bool()
        out_bnsd = self.sdpa(
            q_bnsd, k_bnsd, v_bnsd, attn_mask=mask, is_causal=causal, scale=self.softmax_scale,
            enable_gqa=k_bnsd.shape[1] != q_bnsd.shape[1],
        )  # fmt: skip
        s, b = query.shape[0], query.shape[1]
        return out_bnsd.permute(2, 0, 1, 3).reshape(s, b, -1)
