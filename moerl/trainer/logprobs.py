"""Per-token logprobs from vocab-parallel logits, at the rollout temperature, optionally
restricted to the sampler's kept set (sampling-mask replay).

The engine sampled each response token from the renormalised kept set (top-k / top-p /
min-p); the trainer's logprob of that token must be over the same support for the IS
ratio to compare like with like. The kept set arrives in CSR form, so no dense [T, V]
mask is built: the kept logits are gathered (each TP rank the ones in its vocabulary
shard), and max / sum-exp / label terms are combined across tensor-parallel ranks with
differentiable all-reduces.

The math lives in ``moerl.kernels.logprob.logprobs_from_logits``: its plain-torch twin
on CPU (``moerl.kernels.logprob_torch``), the fused Triton kernel where
``moerl.kernels`` picks it (CUDA tensors, ``trainer.kernels``). This module finds
megatron-core's tensor-parallel group for it.
"""

# T tokens, V vocabulary, Vl this rank's vocabulary shard, N kept (position, id) pairs

from __future__ import annotations

import torch

from moerl.kernels.logprob import logprobs_from_logits


def _tp() -> tuple[torch.distributed.ProcessGroup | None, int, int]:
    """(group, rank, size) of tensor parallelism, or (None, 0, 1) without megatron groups."""
    try:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            return (
                parallel_state.get_tensor_model_parallel_group(),
                parallel_state.get_tensor_model_parallel_rank(),
                parallel_state.get_tensor_model_parallel_world_size(),
            )
    except ImportError:
        pass
    return None, 0, 1


def token_logprobs(
    logits_TVl: torch.Tensor,
    labels_T: torch.Tensor,
    temperature_T: torch.Tensor | float = 1.0,
    *,
    mask_pos_N: torch.Tensor | None = None,
    mask_ids_N: torch.Tensor | None = None,
) -> torch.Tensor:
    """log p(label) for every token, fp32, differentiable w.r.t. the logits.

    ``logits_TVl`` is this rank's vocabulary shard (rank r holds ids [r·Vl, (r+1)·Vl)).
    Tokens listed in ``mask_pos_N`` (with their kept ids ``mask_ids_N``) are normalised
    over their kept set; every other token over the full vocabulary.
    """
    group, _, size = _tp()
    lp_T, _ = logprobs_from_logits(
        logits_TVl, labels_T, temperature_T, mask_pos_N=mask_pos_N, mask_ids_N=mask_ids_N,
        tp_group=group if size > 1 else None,
    )  # fmt: skip
    return lp_T


def csr_to_pairs(
    mask_ids: torch.Tensor, mask_offsets: torch.Tensor, first_pos: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """CSR kept sets of R consecutive positions starting at ``first_pos`` → (pos_N, ids_N)."""
    counts = (mask_offsets[1:] - mask_offsets[:-1]).long()
    pos = first_pos + torch.repeat_interleave(torch.arange(counts.numel()), counts)
    return pos, mask_ids.long()
