"""Per-token log p(label) and entropy at temperature, vocab-parallel, without fp32 logits.

A plain logprob path materialises fp32 logits [T, V] (and exp intermediates of the
same size): at 152K vocabulary × 32K tokens that is ~20 GB per copy. Here the logits
exist one chunk at a time: ``fused_logprobs`` computes each chunk with a cuBLAS matmul
(fp32 output) and hands it to the from-logits Triton kernels (``logprob_triton``) at once;
the forward keeps four fp32 numbers per token, the backward recomputes each chunk's logits
and turns it into d logits against the saved per-token log-normaliser.

These are the trainer's logprobs (``moerl.trainer.logprobs.token_logprobs`` calls
``logprobs_from_logits``), plus entropy, with the
tensor-parallel group passed explicitly (``None``: no TP). With TP each rank holds the
vocabulary shard [r·Vl, (r+1)·Vl); labels and kept ids are global. The max is combined
with an all-reduce MAX and the rescaled sums with one all-reduce SUM; backward needs no
collective for the logits (each rank's shard of the gradient only uses the combined
normaliser — megatron's identity-backward reduce), and one for d hidden (see
``reduce_grad_hidden``).

``use_triton`` picks the kernel (CUDA tensors, or the interpreter under the ``triton``
backend) or the torch twin in ``logprob_torch`` (CPU, or ``MOERL_KERNELS=torch``).
"""

# T tokens, V vocabulary, Vl this rank's vocabulary shard, H hidden, N kept (position, id) pairs

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from moerl.kernels import logprob_torch as twin
from moerl.kernels.dispatch import use_triton

Result = tuple[torch.Tensor, torch.Tensor | None]
# Both Functions save (input, ids_N or weight, the nine per-token / per-pair tensors
# _backward_terms reads, then anything else of their own).
_SHARED = slice(2, 11)


def _ops():  # type: ignore[no-untyped-def]
    from moerl.kernels import logprob_triton  # triton is imported only on this path

    return logprob_triton


def _normalise(stats, kx_N, pos_N, masked_T, with_entropy, group):  # type: ignore[no-untyped-def]
    """Merge this rank's statistics across TP and apply the kept-set normaliser.

    ``stats`` = (max, Σexp(x−max), Σexp(x−max)·x, label logit) over the local shard;
    ``kx_N`` the tempered logits of the local kept pairs. Returns (logprob, entropy or
    None, what backward needs). Kept sums use the full-vocabulary max, as the trainer's
    code does.
    """
    max_T, sum_T, xsum_T, label_T = stats
    top_T = twin.max_tp(max_T.clone(), group)
    scale_T = torch.exp(max_T - top_T)
    kept_N = torch.exp(kx_N - top_T[pos_N])
    zeros_T = torch.zeros_like(max_T)
    sums_5T = torch.stack(
        [
            sum_T * scale_T,
            xsum_T * scale_T,
            label_T,
            zeros_T.index_add(0, pos_N, kept_N),
            zeros_T.index_add(0, pos_N, kept_N * kx_N),
        ]
    )
    if twin.tp_rank_size(group)[1] > 1:
        dist.all_reduce(sums_5T, group=group)
    sum_T, xsum_T, label_T, kept_sum_T, kept_x_T = sums_5T
    log_z_T = top_T + torch.log(sum_T)
    mean_T = xsum_T / sum_T
    kept_sum_T = torch.where(masked_T, kept_sum_T, 1.0).clamp_min(twin.TINY)
    kept_log_z_T = top_T + torch.log(kept_sum_T)
    kept_mean_T = kept_x_T / kept_sum_T
    logprob_T = label_T - torch.where(masked_T, kept_log_z_T, log_z_T)
    entropy_T = None
    if with_entropy:
        entropy_T = torch.where(masked_T, kept_log_z_T - kept_mean_T, log_z_T - mean_T)
    return logprob_T, entropy_T, (log_z_T, mean_T, kept_log_z_T, kept_mean_T)


def _backward_terms(ctx, g_lp_T, g_ent_T):  # type: ignore[no-untyped-def]
    """Per-token coefficients for the dense kernel and d logit of each kept pair.

    Unmasked tokens: dx = g·(onehot − p) + g_H·p·(E[x] − x) over the full vocabulary.
    Masked tokens: the same over their kept set (the pair path) plus g at the label.
    """
    temp_T, local_T, pos_N, kx_N, masked_T, log_z_T, mean_T, kept_log_z_T, kept_mean_T = (
        ctx.saved_tensors[_SHARED]
    )
    g_lp_T = g_lp_T.float().contiguous()
    g_ent_T = g_ent_T.float().contiguous() if ctx.with_entropy else torch.zeros_like(g_lp_T)
    per_token = dict(
        temp=temp_T,
        label=local_T,
        log_z=log_z_T,
        mean=mean_T,
        g_dense=torch.where(masked_T, 0.0, g_lp_T),
        g_entropy=torch.where(masked_T, 0.0, g_ent_T),
        g_label=g_lp_T,
    )
    p_N = torch.exp(kx_N - kept_log_z_T[pos_N])
    d_N = p_N * (g_ent_T[pos_N] * (kept_mean_T[pos_N] - kx_N) - g_lp_T[pos_N]) / temp_T[pos_N]
    return per_token, d_N


def _prepare(src, vocab_local, labels_T, temperature_T, mask_pos_N, mask_ids_N, group):  # type: ignore[no-untyped-def]
    """Kernel-ready per-token vectors and this rank's kept pairs."""
    tokens = src.shape[0]
    rank, _ = twin.tp_rank_size(group)
    start = rank * vocab_local
    temp_T = twin.temperatures(temperature_T, tokens, src.device).contiguous()
    local_T = (labels_T.to(src.device).long() - start).contiguous()
    masked_T = twin.masked_tokens(mask_pos_N, tokens, src.device)
    pos_N = ids_N = torch.zeros(0, dtype=torch.long, device=src.device)
    if mask_pos_N is not None and mask_ids_N is not None and mask_pos_N.numel():
        pos_N, ids_N = twin.local_pairs(
            mask_pos_N.to(src.device), mask_ids_N.to(src.device), start, vocab_local
        )
    return temp_T, local_T, masked_T, pos_N.contiguous(), ids_N.contiguous()


def _finish(ctx, logprob_T, entropy_T):  # type: ignore[no-untyped-def]
    """autograd.Function outputs are tensors: a placeholder stands in for "no entropy"."""
    if entropy_T is None:
        entropy_T = torch.zeros_like(logprob_T)
        ctx.mark_non_differentiable(entropy_T)
    return logprob_T, entropy_T


class _FromLogits(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        logits_TVl,
        labels_T,
        temperature_T,
        mask_pos_N,
        mask_ids_N,
        with_entropy,
        chunk_vocab,
        group,
    ):  # type: ignore[no-untyped-def,override]
        ops = _ops()
        temp_T, local_T, masked_T, pos_N, ids_N = _prepare(
            logits_TVl, logits_TVl.shape[1], labels_T, temperature_T, mask_pos_N, mask_ids_N, group
        )
        stats = ops.dense_stats(logits_TVl, temp_T, local_T, chunk_vocab, with_entropy)
        kx_N = logits_TVl[pos_N, ids_N].float() / temp_T[pos_N]
        logprob_T, entropy_T, saved = _normalise(stats, kx_N, pos_N, masked_T, with_entropy, group)
        ctx.save_for_backward(logits_TVl, ids_N, temp_T, local_T, pos_N, kx_N, masked_T, *saved)
        ctx.with_entropy = with_entropy
        return _finish(ctx, logprob_T, entropy_T)

    @staticmethod
    @once_differentiable
    def backward(ctx, g_lp_T, g_ent_T):  # type: ignore[no-untyped-def,override]
        logits_TVl, ids_N = ctx.saved_tensors[:2]
        pos_N = ctx.saved_tensors[4]
        per_token, d_N = _backward_terms(ctx, g_lp_T, g_ent_T)
        tokens, vocab_local = logits_TVl.shape
        dlogits_TVl = _ops().dlogits(
            logits_TVl,
            (0, tokens),
            (0, vocab_local),
            per_token,
            logits_TVl.dtype,
            ctx.with_entropy,
        )
        dlogits_TVl.index_put_((pos_N, ids_N), d_N.to(dlogits_TVl.dtype), accumulate=True)
        return dlogits_TVl, None, None, None, None, None, None, None


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` in fp32: bf16/fp16 products accumulate in fp32 and are not rounded back
    (cuBLAS's ``out_dtype`` on CUDA; an upcast where that does not exist, e.g. the CPU)."""
    if a.dtype == torch.float32:
        return a @ b
    if a.is_cuda and _MM_OUT_DTYPE[0]:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (RuntimeError, TypeError):  # an older torch: the upcast below
            _MM_OUT_DTYPE[0] = False
    return a.float() @ b.float()


_MM_OUT_DTYPE = [True]


def _ranges(total: int, step: int) -> list[tuple[int, int]]:
    return [(i, min(total, i + step)) for i in range(0, total, max(1, step))]


class _FromHidden(torch.autograd.Function):
    """Logits chunk by chunk from cuBLAS matmuls with fp32 output, each consumed at once
    by the from-logits kernels: the forward keeps the per-token statistics of
    ``rows × Vl`` chunks (rows = chunk_tokens·chunk_vocab / Vl); the backward walks
    vocabulary chunks of ``chunk_vocab`` columns, and in each, token chunks of
    ``chunk_tokens`` rows: recompute the chunk's logits, d logits (kernel), then
    d hidden += d logits · W (fp32) and the chunk's d weight (fp32, written once per
    vocabulary chunk). The matmuls run at cuBLAS speed; what stays alive is one chunk of
    logits and d logits, d hidden in fp32 and one vocabulary chunk of d weight in fp32."""

    @staticmethod
    def forward(
        ctx,
        hidden_TH,
        weight_VlH,
        labels_T,
        temperature_T,
        mask_pos_N,
        mask_ids_N,
        with_entropy,
        chunk_tokens,
        chunk_vocab,
        group,
        reduce_grad_hidden,
    ):  # type: ignore[no-untyped-def,override]
        ops = _ops()
        temp_T, local_T, masked_T, pos_N, ids_N = _prepare(
            hidden_TH, weight_VlH.shape[0], labels_T, temperature_T, mask_pos_N, mask_ids_N, group
        )
        tokens, vocab_local = hidden_TH.shape[0], weight_VlH.shape[0]
        rows = max(1, chunk_tokens * chunk_vocab // max(1, vocab_local))
        parts = []
        for t0, t1 in _ranges(tokens, rows):
            logits_tV = _mm_f32(hidden_TH[t0:t1], weight_VlH.T)
            parts.append(
                ops.dense_stats(logits_tV, temp_T[t0:t1], local_T[t0:t1], chunk_vocab, with_entropy)
            )
            del logits_tV
        stats = tuple(torch.cat(column) for column in zip(*parts))
        kx_N = ops.pair_dot(hidden_TH, weight_VlH, pos_N, ids_N) / temp_T[pos_N]
        logprob_T, entropy_T, saved = _normalise(stats, kx_N, pos_N, masked_T, with_entropy, group)
        ctx.save_for_backward(
            hidden_TH, weight_VlH, temp_T, local_T, pos_N, kx_N, masked_T, *saved, ids_N
        )
        ctx.with_entropy = with_entropy
        ctx.chunks = (chunk_tokens, chunk_vocab)
        ctx.group, ctx.reduce_grad_hidden = group, reduce_grad_hidden
        return _finish(ctx, logprob_T, entropy_T)

    @staticmethod
    @once_differentiable
    def backward(ctx, g_lp_T, g_ent_T):  # type: ignore[no-untyped-def,override]
        """Vocabulary chunks outside, token chunks inside (the class docstring); the kept
        pairs' terms are added by an atomic scatter kernel, into d hidden at once and into
        each vocabulary chunk's d weight."""
        hidden_TH, weight_VlH = ctx.saved_tensors[:2]
        pos_N, ids_N = ctx.saved_tensors[4], ctx.saved_tensors[-1]
        per_token, d_N = _backward_terms(ctx, g_lp_T, g_ent_T)
        (tokens, hidden), vocab_local = hidden_TH.shape, weight_VlH.shape[0]
        want_h, want_w = ctx.needs_input_grad[:2]
        f32 = dict(dtype=torch.float32, device=hidden_TH.device)
        dh_TH = torch.zeros(tokens, hidden, **f32) if want_h else None  # type: ignore[arg-type]
        dw_VlH = torch.empty_like(weight_VlH) if want_w else None
        chunk_t, chunk_v = ctx.chunks
        ops = _ops()
        if pos_N.numel():  # pairs by id, so each vocabulary chunk's are one slice
            order = torch.argsort(ids_N)
            pos_s, ids_s, d_s = pos_N[order], ids_N[order], d_N[order]
            edges = torch.searchsorted(
                ids_s, torch.arange(0, vocab_local, chunk_v, device=ids_s.device)
            )
            bounds = [*edges.tolist(), ids_s.numel()]
            ops.pair_scatter(hidden_TH, weight_VlH, pos_N, ids_N, d_N, dh_TH, None)
        for k, (v0, v1) in enumerate(_ranges(vocab_local, chunk_v)):
            w_vH = weight_VlH[v0:v1]
            dw_vH = torch.zeros(v1 - v0, hidden, **f32) if want_w else None  # type: ignore[arg-type]
            for t0, t1 in _ranges(tokens, chunk_t):
                chunk = {name: vec[t0:t1] for name, vec in per_token.items()}
                chunk["label"] = chunk["label"] - v0
                dl_tv = ops.dlogits(
                    _mm_f32(hidden_TH[t0:t1], w_vH.T),
                    (0, t1 - t0),
                    (0, v1 - v0),
                    chunk,
                    hidden_TH.dtype,
                    ctx.with_entropy,
                )
                if dh_TH is not None:
                    dh_TH[t0:t1].add_(_mm_f32(dl_tv, w_vH))
                if dw_vH is not None:
                    dw_vH.add_(_mm_f32(dl_tv.T, hidden_TH[t0:t1]))
                del dl_tv
            if dw_VlH is not None and dw_vH is not None:
                if pos_N.numel() and bounds[k] < bounds[k + 1]:
                    a, b = bounds[k], bounds[k + 1]
                    ops.pair_scatter(
                        hidden_TH, w_vH, pos_s[a:b], ids_s[a:b] - v0, d_s[a:b], None, dw_vH
                    )
                dw_VlH[v0:v1] = dw_vH
        if dh_TH is not None and ctx.reduce_grad_hidden and twin.tp_rank_size(ctx.group)[1] > 1:
            dist.all_reduce(dh_TH, group=ctx.group)
        dh = dh_TH.to(hidden_TH.dtype) if dh_TH is not None else None
        return dh, dw_VlH, None, None, None, None, None, None, None, None, None


def _check_mask(mask_pos_N: torch.Tensor | None, mask_ids_N: torch.Tensor | None) -> None:
    if (mask_pos_N is None) != (mask_ids_N is None):
        raise ValueError("pass both mask_pos_N and mask_ids_N (the kept pairs), or neither")
    if mask_pos_N is not None and mask_pos_N.shape != mask_ids_N.shape:  # type: ignore[union-attr]
        raise ValueError(
            f"mask_pos_N {tuple(mask_pos_N.shape)} and mask_ids_N "
            f"{tuple(mask_ids_N.shape)} must pair up one to one"  # type: ignore[union-attr]
        )


def logprobs_from_logits(
    logits_TVl: torch.Tensor,
    labels_T: torch.Tensor,
    temperature_T: torch.Tensor | float = 1.0,
    *,
    mask_pos_N: torch.Tensor | None = None,
    mask_ids_N: torch.Tensor | None = None,
    with_entropy: bool = False,
    chunk_vocab: int = 32768,
    tp_group: dist.ProcessGroup | None = None,
) -> Result:
    """(log p(label), entropy or None) per token, fp32 [T], from this rank's logits shard.

    A drop-in for ``token_logprobs`` (pass megatron's TP group explicitly) that reads the
    logits in their own dtype: no fp32 copy and no [T, Vl] exp intermediates; backward
    writes d logits once, in the logits' dtype.
    """
    _check_mask(mask_pos_N, mask_ids_N)
    if logits_TVl.ndim != 2 or labels_T.shape != logits_TVl.shape[:1]:
        raise ValueError(
            f"logits {tuple(logits_TVl.shape)} must be [T, Vl] and labels "
            f"{tuple(labels_T.shape)} [T]"
        )
    if not use_triton(logits_TVl) or logits_TVl.shape[0] == 0:
        return twin.logprobs_from_logits_torch(
            logits_TVl,
            labels_T,
            temperature_T,
            mask_pos_N=mask_pos_N,
            mask_ids_N=mask_ids_N,
            with_entropy=with_entropy,
            tp_group=tp_group,
        )
    logprob_T, entropy_T = _FromLogits.apply(
        logits_TVl,
        labels_T,
        temperature_T,
        mask_pos_N,
        mask_ids_N,
        with_entropy,
        chunk_vocab,
        tp_group,
    )
    return logprob_T, entropy_T if with_entropy else None


def fused_logprobs(
    hidden_TH: torch.Tensor,
    weight_VlH: torch.Tensor,
    labels_T: torch.Tensor,
    temperature_T: torch.Tensor | float = 1.0,
    *,
    mask_pos_N: torch.Tensor | None = None,
    mask_ids_N: torch.Tensor | None = None,
    with_entropy: bool = False,
    chunk_tokens: int = 4096,
    chunk_vocab: int = 8192,
    tp_group: dist.ProcessGroup | None = None,
    reduce_grad_hidden: bool = True,
) -> Result:
    """(log p(label), entropy or None) per token, fp32 [T], from the last hidden states
    and this rank's shard of the output-layer weight — the logits never exist whole.

    ``chunk_tokens`` × ``chunk_vocab`` elements bound each chunk of logits (fp32) and
    d logits (the inputs' dtype): the backward's chunks are that shape, the forward's span
    the whole shard and as many tokens as fit; ``chunk_vocab`` also splits each chunk's
    vocabulary across kernel programs. ``reduce_grad_hidden``: all-reduce d hidden over ``tp_group`` in backward,
    as ColumnParallelLinear's input copy does; pass False when the caller's own op sums
    it (sequence parallelism: ``gather_from_sequence_parallel_region``).
    """
    _check_mask(mask_pos_N, mask_ids_N)
    if hidden_TH.ndim != 2 or weight_VlH.ndim != 2 or hidden_TH.shape[1] != weight_VlH.shape[1]:
        raise ValueError(
            f"hidden {tuple(hidden_TH.shape)} must be [T, H] and weight "
            f"{tuple(weight_VlH.shape)} [Vl, H] with the same H"
        )
    if labels_T.shape != hidden_TH.shape[:1]:
        raise ValueError(f"labels {tuple(labels_T.shape)} must be [T] = {hidden_TH.shape[0]}")
    if hidden_TH.dtype != weight_VlH.dtype:
        raise ValueError(f"hidden is {hidden_TH.dtype} but weight is {weight_VlH.dtype}")
    if min(chunk_tokens, chunk_vocab) < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens}, chunk_vocab={chunk_vocab}: both ≥ 1")
    if not use_triton(hidden_TH, weight_VlH) or hidden_TH.shape[0] == 0:
        return twin.fused_logprobs_torch(
            hidden_TH,
            weight_VlH,
            labels_T,
            temperature_T,
            mask_pos_N=mask_pos_N,
            mask_ids_N=mask_ids_N,
            with_entropy=with_entropy,
            tp_group=tp_group,
            reduce_grad_hidden=reduce_grad_hidden,
        )
    logprob_T, entropy_T = _FromHidden.apply(
        hidden_TH,
        weight_VlH,
        labels_T,
        temperature_T,
        mask_pos_N,
        mask_ids_N,
        with_entropy,
        chunk_tokens,
        chunk_vocab,
        tp_group,
        reduce_grad_hidden,
    )
    return logprob_T, entropy_T if with_entropy else None
