"""Torch twin of the routing-replay gather: megatron-core's own formula, op for op.

Under Keep Routing the router's top-k is replaced by the replayed experts, and
megatron-core 0.16 (``topk_routing_with_score_function`` in
``transformer/moe/moe_utils.py``) turns the gathered scores into probabilities with

    scores = torch.gather(scores, 1, top_indices)          # via RouterReplay.get_replay_topk
    probs = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20) if topk > 1 else scores
    if scaling_factor:
        probs = probs * scaling_factor

(the sigmoid score function; softmax routers with ``use_pre_softmax`` only gather and
scale). Every op runs in the scores' dtype, so on bf16 scores the twin is bitwise
megatron's result; the kernel computes in fp32 and rounds once.
"""

# T tokens, E experts, K top-k

from __future__ import annotations

import torch


def replay_gather_torch(
    scores_TE: torch.Tensor,
    idx_TK: torch.Tensor,
    *,
    normalize: bool,
    scale: float = 1.0,
    eps: float = 1e-20,
) -> torch.Tensor:
    """``scale · s / (Σ_k s + eps)`` (or ``scale · s``) of the gathered scores ``s``;
    ``normalize`` here is already megatron's ``normalize and K > 1``."""
    probs_TK = scores_TE.gather(1, idx_TK.long())
    if normalize:
        probs_TK = probs_TK / (probs_TK.sum(dim=-1, keepdim=True) + eps)
    if scale != 1.0:
        probs_TK = probs_TK * scale
    return probs_TK
