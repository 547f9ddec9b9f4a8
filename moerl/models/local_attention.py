"""Core attention for multi-latent attention without transformer-engine.

megatron-core's ``MLASelfAttention`` builds its core attention with separate
key and value head sizes (``k_channels``, ``v_channels``) and its own softmax
scale (YaRN ``mscale``), which only TE's attention accepts; the local
``DotProductAttention`` does not. This module is the local (non-TE) stand-in:
causal scaled-dot-product attention over ``[s, b, heads, dim]`` tensors, via
``torch.nn.functional.scaled_dot_product_attention``.
"""

# s sequence, b batch, n heads on this TP rank, dk / dv key and value head dims

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule


class LocalMLACoreAttention(MegatronModule):
    """Causal SDPA with distinct key/value head dims (see module docstring)."""

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
            raise ValueError("context parallelism with MLA needs transformer-engine")
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale
        self.k_channels = k_channels
        self.v_channels = v_channels

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
        out_bnsd = F.scaled_dot_product_attention(
            q_bnsd, k_bnsd, v_bnsd, attn_mask=mask, is_causal=causal, scale=self.softmax_scale
        )
        s, b = query.shape[0], query.shape[1]
        return out_bnsd.permute(2, 0, 1, 3).reshape(s, b, -1)
