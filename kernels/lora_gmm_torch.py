"""Torch twin of the per-expert LoRA grouped matmul: a plain loop over experts.

This is what the adapters compute today when megatron-core's SequentialMLP runs each
local expert on its slice of the permuted tokens: two small ``F.linear`` per expert
forward and four backward, in the order ``LoraAdapter.delta`` uses (``B (A x)`` then
the scaling). It defines the kernel's semantics, runs anywhere, and is the baseline the
benchmark measures the kernel against.
"""

# T tokens (grouped by expert), E experts, I in features, O out features, r rank

from __future__ import annotations

import torch
import torch.nn.functional as F


def split_sizes(tokens_per_expert_E: torch.Tensor) -> list[int]:
    """Segment lengths as host ints (a device sync when the counts live on a GPU, as in
    megatron-core's own ``tokens_per_expert.tolist()``)."""
    return [int(c) for c in tokens_per_expert_E.tolist()]


def lora_grouped_torch(
    x_TI: torch.Tensor,
    a_ErI: torch.Tensor,
    b_EOr: torch.Tensor,
    tokens_per_expert_E: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """``y = scaling · (x A_eᵀ) B_eᵀ`` on each expert's segment of ``x``; autograd does the
    backward, so an expert with no tokens gets exactly zero gradients."""
    outs = []
    for e, x_tI in enumerate(torch.split(x_TI, split_sizes(tokens_per_expert_E))):
        outs.append(F.linear(F.linear(x_tI, a_ErI[e]), b_EOr[e]) * scaling)
    return torch.cat(outs, dim=0)
