"""Per-expert LoRA on tokens grouped by expert, as one grouped matmul instead of a loop.

In the trainer, megatron-core's SequentialMLP hands each local expert its slice of the
permuted tokens (``tokens_per_expert`` counts them, in expert order), and every expert's
adapter adds ``scaling · B_e A_e x`` to its linear. Done per expert that is two tiny
GEMMs forward and four backward per expert, each with rank-r (4..64) inner or outer
dims that leave a GPU mostly idle, plus the split and concatenation around them: with
64 local experts, hundreds of launches per MoE layer and micro-batch.

``lora_grouped`` computes every expert's delta at once: one launch for all experts'
``h = x A_eᵀ``, one for all ``y = scaling · h B_eᵀ``, and four for the backward
(``dh``, ``dx``, ``dA``, ``dB``), each a segment GEMM over the grouped tokens. The
Triton kernel runs when ``moerl.kernels.dispatch.use_triton`` says so (CUDA inputs and
Triton importable, or ``backend("triton")``); the torch twin (a per-expert loop)
otherwise.
"""

# T tokens (grouped by expert), E experts, I in features, O out features, r rank

from __future__ import annotations

from collections.abc import Sequence

import torch

from moerl.kernels.dispatch import use_triton
from moerl.kernels.lora_gmm_torch import lora_grouped_torch


def _counts(
    tokens_per_expert: torch.Tensor | Sequence[int], experts: int, tokens: int
) -> torch.Tensor:
    counts_E = torch.as_tensor(tokens_per_expert)
    if counts_E.dim() != 1 or counts_E.shape[0] != experts:
        raise ValueError(
            f"tokens_per_expert has shape {tuple(counts_E.shape)}; expected one count per "
            f"expert ({experts},)"
        )
    if counts_E.is_floating_point() or counts_E.is_complex():
        raise ValueError(f"tokens_per_expert must hold integers, not {counts_E.dtype}")
    # Checking on a GPU would cost a sync per call; megatron's counts always add up.
    if not counts_E.is_cuda:
        total = int(counts_E.sum())
        if total != tokens or bool((counts_E < 0).any()):
            raise ValueError(
                f"tokens_per_expert={counts_E.tolist()} must be non-negative and add up to "
                f"the {tokens} tokens of x"
            )
    return counts_E


def lora_grouped(
    x_TI: torch.Tensor,
    a_ErI: torch.Tensor,
    b_EOr: torch.Tensor,
    tokens_per_expert_E: torch.Tensor | Sequence[int],
    scaling: float,
) -> torch.Tensor:
    """The LoRA delta of E experts on tokens grouped by expert.

    ``x_TI``: the experts' inputs, expert 0's tokens first (megatron's permuted local
    hidden states; apply adapter dropout before). ``a_ErI``, ``b_EOr``: each expert's
    A and B (``torch.stack`` of the per-expert parameters works, gradients flow back to
    them). ``tokens_per_expert_E``: segment lengths, on the CPU or the device; zero is
    fine. A and B are cast to ``x``'s dtype. Returns ``y_TO`` with
    ``y[seg e] = scaling · (x[seg e] A_eᵀ) B_eᵀ``; the backward gives dx, dA and dB, with
    zeros for experts that got no tokens.
    """
    if x_TI.dim() != 2 or a_ErI.dim() != 3 or b_EOr.dim() != 3:
        raise ValueError(
            f"lora_grouped takes x [T, I], A [E, r, I], B [E, O, r]; got x "
            f"{tuple(x_TI.shape)}, A {tuple(a_ErI.shape)}, B {tuple(b_EOr.shape)}"
        )
    experts, rank, in_features = a_ErI.shape
    if x_TI.shape[1] != in_features or b_EOr.shape[0] != experts or b_EOr.shape[2] != rank:
        raise ValueError(
            f"lora_grouped: x {tuple(x_TI.shape)}, A {tuple(a_ErI.shape)} and B "
            f"{tuple(b_EOr.shape)} disagree; expected x [T, I], A [E, r, I], B [E, O, r]"
        )
    counts_E = _counts(tokens_per_expert_E, experts, x_TI.shape[0])
    a_ErI = a_ErI.to(x_TI.dtype)
    b_EOr = b_EOr.to(x_TI.dtype)
    if use_triton(x_TI, a_ErI, b_EOr):
        from moerl.kernels.lora_gmm_triton import lora_grouped_triton

        return lora_grouped_triton(x_TI, a_ErI, b_EOr, counts_E, float(scaling))
    return lora_grouped_torch(x_TI, a_ErI, b_EOr, counts_E, scaling)
