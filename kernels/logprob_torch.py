"""Torch twins of the fused logprob + entropy kernels: the oracle and the CPU fallback.

Plain autograd over materialised fp32 logits; ``logprobs_from_logits_torch`` is also
the trainer's CPU path (``moerl.trainer.logprobs.token_logprobs`` calls it through the
dispatch with megatron's TP group): temperature divides the logits, the max is all-reduced on
detached values, sums are all-reduced forward with an identity backward (megatron's
``reduce_from_tensor_model_parallel_region``), and tokens listed in the CSR sampling
mask are normalised over their kept ids only. The Triton path in
``moerl.kernels.logprob`` must agree with these to rounding.

The collective helpers here are shared with the kernel path, so both combine shards the
same way.
"""

# T tokens, V vocabulary, Vl this rank's vocabulary shard, H hidden, N kept (position, id) pairs

from __future__ import annotations

import torch
import torch.distributed as dist

TINY = torch.finfo(torch.float32).tiny


def tp_rank_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(rank, size) in the tensor-parallel group; ``None`` means no tensor parallelism."""
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


class _SumTP(torch.autograd.Function):
    """All-reduce sum forward, identity backward: every rank's loss is the same replicated
    function of the reduced value, so each rank back-propagates into its own shard only."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


class _CopyTP(torch.autograd.Function):
    """Identity forward, all-reduce backward: a replicated input feeding vocab-sharded
    logits gets a partial gradient on each rank (ColumnParallelLinear's input copy)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sum_tp(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return x if tp_rank_size(group)[1] == 1 else _SumTP.apply(x, group)


def max_tp(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """In-place all-reduce MAX of a detached tensor (the max only shifts the exponent)."""
    if tp_rank_size(group)[1] > 1:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
    return x


def temperatures(
    temperature_T: torch.Tensor | float, tokens: int, device: torch.device
) -> torch.Tensor:
    """Per-token fp32 temperatures, clamped like the trainer's so T=0 (greedy) stays finite."""
    if not torch.is_tensor(temperature_T):
        temperature_T = torch.full((tokens,), float(temperature_T))
    return temperature_T.to(device, torch.float32).expand(tokens).clamp_min(1e-6)


def local_pairs(
    mask_pos_N: torch.Tensor, mask_ids_N: torch.Tensor, start: int, vocab_local: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept (position, id) pairs whose id lies in this rank's shard, ids made local."""
    mine = (mask_ids_N >= start) & (mask_ids_N < start + vocab_local)
    return mask_pos_N[mine].long(), (mask_ids_N[mine] - start).long()


def masked_tokens(mask_pos_N: torch.Tensor | None, tokens: int, device: torch.device):  # type: ignore[no-untyped-def]
    """bool [T]: which tokens are normalised over a kept set (every rank agrees)."""
    masked_T = torch.zeros(tokens, dtype=torch.bool, device=device)
    if mask_pos_N is not None and mask_pos_N.numel():
        masked_T[mask_pos_N.long()] = True
    return masked_T


def logprobs_from_logits_torch(
    logits_TVl: torch.Tensor,
    labels_T: torch.Tensor,
    temperature_T: torch.Tensor | float = 1.0,
    *,
    mask_pos_N: torch.Tensor | None = None,
    mask_ids_N: torch.Tensor | None = None,
    with_entropy: bool = False,
    tp_group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(label), entropy or None), fp32 [T], differentiable w.r.t. the logits."""
    rank, _ = tp_rank_size(tp_group)
    tokens, vocab_local = logits_TVl.shape
    start = rank * vocab_local
    temp_T = temperatures(temperature_T, tokens, logits_TVl.device)
    x_TVl = logits_TVl.float() / temp_T[:, None]

    max_T = max_tp(x_TVl.detach().max(dim=-1).values, tp_group)
    e_TVl = torch.exp(x_TVl - max_T[:, None])
    sumexp_T = sum_tp(e_TVl.sum(-1), tp_group)
    log_z_T = max_T + torch.log(sumexp_T)
    entropy_T = None
    if with_entropy:  # H = log Z − E_p[x]
        entropy_T = log_z_T - sum_tp((e_TVl * x_TVl).sum(-1), tp_group) / sumexp_T

    masked_T = masked_tokens(mask_pos_N, tokens, logits_TVl.device)
    if mask_pos_N is not None and mask_ids_N is not None and mask_pos_N.numel():
        pos_N, ids_N = local_pairs(mask_pos_N, mask_ids_N, start, vocab_local)
        x_N = x_TVl[pos_N, ids_N]
        kept_N = torch.exp(x_N - max_T[pos_N])
        zeros_T = torch.zeros(tokens, device=x_TVl.device)
        kept_sum_T = sum_tp(zeros_T.index_add(0, pos_N, kept_N), tp_group)
        # Unmasked tokens read 1 here, so no branch of the where below divides by zero.
        kept_sum_T = torch.where(masked_T, kept_sum_T, 1.0).clamp_min(TINY)
        kept_log_z_T = max_T + torch.log(kept_sum_T)
        log_z_T = torch.where(masked_T, kept_log_z_T, log_z_T)
        if entropy_T is not None:
            kept_x_T = sum_tp(zeros_T.index_add(0, pos_N, kept_N * x_N), tp_group)
            entropy_T = torch.where(masked_T, kept_log_z_T - kept_x_T / kept_sum_T, entropy_T)

    here_T = (labels_T >= start) & (labels_T < start + vocab_local)
    local_T = (labels_T - start).clamp(0, vocab_local - 1).long()
    label_T = sum_tp(x_TVl.gather(1, local_T[:, None]).squeeze(1) * here_T, tp_group)
    return label_T - log_z_T, entropy_T


def fused_logprobs_torch(
    hidden_TH: torch.Tensor,
    weight_VlH: torch.Tensor,
    labels_T: torch.Tensor,
    temperature_T: torch.Tensor | float = 1.0,
    *,
    mask_pos_N: torch.Tensor | None = None,
    mask_ids_N: torch.Tensor | None = None,
    with_entropy: bool = False,
    tp_group: dist.ProcessGroup | None = None,
    reduce_grad_hidden: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``fused_logprobs`` by materialising the fp32 logits shard ``hidden @ weightᵀ``.

    bf16/fp16 products are exact in fp32, so this is the kernel's fp32-accumulate matmul
    without its blocking. It keeps every [T, Vl] intermediate for autograd: the oracle,
    not a memory saver.
    """
    if reduce_grad_hidden and tp_rank_size(tp_group)[1] > 1:
        hidden_TH = _CopyTP.apply(hidden_TH, tp_group)
    logits_TVl = hidden_TH.float() @ weight_VlH.float().T
    return logprobs_from_logits_torch(
        logits_TVl,
        labels_T,
        temperature_T,
        mask_pos_N=mask_pos_N,
        mask_ids_N=mask_ids_N,
        with_entropy=with_entropy,
        tp_group=tp_group,
    )
