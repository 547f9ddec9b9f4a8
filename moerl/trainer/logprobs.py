"""Per-token logprobs from vocab-parallel logits, at the rollout temperature, optionally
restricted to the sampler's kept set (sampling-mask replay).

The engine sampled each response token from the renormalised kept set (top-k / top-p /
min-p); the trainer's logprob of that token must be over the same support for the IS
ratio to compare like with like. The kept set arrives in CSR form, so this never builds a
dense [T, V] mask: it gathers the kept logits (each TP rank the ones in its vocabulary
shard), and combines max / sum-exp / label terms across tensor-parallel ranks with
differentiable all-reduces.

This plain-torch code is the reference and the CPU path. Where ``moerl.kernels``
picks Triton (CUDA tensors, ``trainer.kernels``), the same logprobs come from
``moerl.kernels.logprob.logprobs_from_logits``, which never builds fp32 [T, V] copies.
"""

# T tokens, V vocabulary, Vl this rank's vocabulary shard, N kept (position, id) pairs

from __future__ import annotations

import torch
import torch.distributed as dist

from moerl.kernels.dispatch import use_triton


def _tp() -> tuple[object | None, int, int]:
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


def _sum_tp(x: torch.Tensor, group: object | None, size: int) -> torch.Tensor:
    """All-reduce sum forward, identity backward (the result feeds replicated math)."""
    if size == 1:
        return x
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(x, group=group)


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
    group, rank, size = _tp()
    if use_triton(logits_TVl):  # CUDA (trainer.kernels): the fused kernel, no fp32 copy
        from moerl.kernels.logprob import logprobs_from_logits

        lp_T, _ = logprobs_from_logits(
            logits_TVl, labels_T, temperature_T, mask_pos_N=mask_pos_N, mask_ids_N=mask_ids_N,
            tp_group=group if size > 1 else None,
        )  # fmt: skip
        return lp_T
    tokens, vocab_local = logits_TVl.shape
    start = rank * vocab_local
    if not torch.is_tensor(temperature_T):
        temperature_T = torch.full((tokens,), float(temperature_T))
    x_TVl = (
        logits_TVl.float() / temperature_T.to(logits_TVl.device).float().clamp_min(1e-6)[:, None]
    )

    max_T = x_TVl.detach().max(dim=-1).values
    if size > 1:
        dist.all_reduce(max_T, op=dist.ReduceOp.MAX, group=group)
    sumexp_T = _sum_tp(torch.exp(x_TVl - max_T[:, None]).sum(-1), group, size)
    log_z_T = max_T + torch.log(sumexp_T)

    if mask_pos_N is not None and mask_ids_N is not None and mask_pos_N.numel():
        mine = (mask_ids_N >= start) & (mask_ids_N < start + vocab_local)
        pos, ids = mask_pos_N[mine], mask_ids_N[mine] - start
        kept = torch.exp(x_TVl[pos, ids] - max_T[pos])
        kept_sum_T = _sum_tp(
            torch.zeros(tokens, device=x_TVl.device).index_add(0, pos, kept), group, size
        )
        masked_T = torch.zeros(tokens, dtype=torch.bool, device=x_TVl.device)
        masked_T[mask_pos_N] = True
        # Kept sets always contain a positive-probability token; guard the log anyway.
        kept_log_z_T = max_T + torch.log(kept_sum_T.clamp_min(torch.finfo(torch.float32).tiny))
        log_z_T = torch.where(masked_T, kept_log_z_T, log_z_T)

    here_T = (labels_T >= start) & (labels_T < start + vocab_local)
    local_T = (labels_T - start).clamp(0, vocab_local - 1)
    label_T = x_TVl.gather(1, local_T[:, None]).squeeze(1) * here_T
    label_T = _sum_tp(label_T, group, size)
    return label_T - log_z_T


def csr_to_pairs(
    mask_ids: torch.Tensor, mask_offsets: torch.Tensor, first_pos: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """CSR kept sets of R consecutive positions starting at ``first_pos`` → (pos_N, ids_N)."""
    counts = (mask_offsets[1:] - mask_offsets[:-1]).long()
    pos = first_pos + torch.repeat_interleave(torch.arange(counts.numel()), counts)
    return pos, mask_ids.long()
