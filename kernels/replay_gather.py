"""The routing-replay gather: replayed experts' scores, renormalised and scaled, in one pass.

Under Keep Routing (``moerl/trainer/replay.py``) the router does not pick its top-k: the
engine's recorded experts replace it, and megatron-core gathers their scores, then (for
sigmoid routers) divides by their sum and multiplies by
``moe_router_topk_scaling_factor``. Unfused that is a gather, a sum, an add, a divide
and a multiply forward, each a launch and a pass over [T, K], and more backward, where
the gather's gradient also needs a zero-filled [T, E] buffer and a scatter.

``replay_gather`` does the forward in one kernel and the backward in one kernel that
writes each row of the [T, E] score gradient densely (zeros where no replayed expert
points, no separate fill), summing repeated indices like ``gather``'s backward. The
torch twin (``replay_gather_torch.py``) is megatron's own formula.
"""

# T tokens, E experts, K top-k

from __future__ import annotations

import torch

from moerl.kernels.dispatch import use_triton
from moerl.kernels.replay_gather_torch import replay_gather_torch


def replay_gather(
    scores_TE: torch.Tensor,
    idx_TK: torch.Tensor,
    *,
    normalize: bool,
    scale: float = 1.0,
    eps: float = 1e-20,
) -> torch.Tensor:
    """Routing probabilities ``probs_TK`` of the replayed experts ``idx_TK``.

    ``probs = scale · s / (Σ_k s + eps)`` with ``s = scores.gather(1, idx)`` when
    ``normalize`` (megatron's sigmoid routers), else ``scale · s``. As in megatron, a
    top-1 route is never renormalised (``normalize`` is ignored when K == 1). Pass
    ``scale = config.moe_router_topk_scaling_factor or 1.0`` (megatron skips a falsy
    factor). Indices must lie in [0, E); the kernel reads a zero score outside.
    Differentiable in ``scores_TE`` (zero gradient where no index points).
    """
    if scores_TE.dim() != 2 or idx_TK.dim() != 2 or idx_TK.shape[0] != scores_TE.shape[0]:
        raise ValueError(
            f"replay_gather takes scores [T, E] and indices [T, K]; got "
            f"{tuple(scores_TE.shape)} and {tuple(idx_TK.shape)}"
        )
    if idx_TK.is_floating_point() or idx_TK.dtype == torch.bool:
        raise ValueError(f"replay indices must be integers, not {idx_TK.dtype}")
    if not scores_TE.is_floating_point():
        raise ValueError(f"router scores must be floating point, not {scores_TE.dtype}")
    normalize = normalize and idx_TK.shape[1] > 1
    if use_triton(scores_TE, idx_TK):
        from moerl.kernels.replay_gather_triton import replay_gather_triton

        return replay_gather_triton(scores_TE, idx_TK, normalize, float(scale), float(eps))
    return replay_gather_torch(scores_TE, idx_TK, normalize=normalize, scale=scale, eps=eps)
