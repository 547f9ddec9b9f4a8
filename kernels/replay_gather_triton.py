"""Triton kernels for the routing-replay gather (see ``replay_gather.py``).

Forward: a program owns a block of tokens and their K replayed experts; it gathers the
K scores (one row each, K ≤ a few dozen), sums them in fp32, divides, scales, and
writes ``probs_TK`` in the scores' dtype.

Backward: with ``D = Σ_k s_k + eps``, ``∂probs_k/∂s_j = scale · (δ_kj / D − s_k / D²)``,
so ``ds_j = scale · (g_j − Σ_k g_k s_k / D) / D`` (``scale · g_j`` unnormalised). A
program owns a (token block, expert block) tile of the [T, E] gradient: it recomputes
``ds`` for its tokens (cheaper than storing it) and writes every column of the tile,
``Σ_k [idx_k == e] · ds_k`` — zeros where no replayed expert points, a sum where one is
repeated — so the gradient needs neither a zero fill nor a scatter, and is deterministic.
"""

# T tokens, E experts, K top-k

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moerl.kernels.dispatch import interpreting


@triton.jit
def _gather_rows(scores_ptr, idx_ptr, rows, T, E, K, s_s_t, s_s_e, s_i_t, s_i_k, KP: tl.constexpr):
    """(idx, fp32 scores) of a block of tokens' K slots; -1 and 0 in padding slots."""
    ks = tl.arange(0, KP)
    ok = (rows < T)[:, None] & (ks < K)[None, :]
    rows = rows.to(tl.int64)
    idx = tl.load(idx_ptr + rows[:, None] * s_i_t + ks[None, :] * s_i_k, mask=ok, other=-1)
    ok = ok & (idx >= 0) & (idx < E)
    s = tl.load(scores_ptr + rows[:, None] * s_s_t + idx * s_s_e, mask=ok, other=0.0)
    return tl.where(ok, idx, -1), s.to(tl.float32)


@triton.jit
def _replay_fwd(
    scores_ptr, idx_ptr, out_ptr,
    T, E, K, scale, eps,
    s_s_t, s_s_e, s_i_t, s_i_k, s_o_t, s_o_k,
    NORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, KP: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    _, s = _gather_rows(scores_ptr, idx_ptr, rows, T, E, K, s_s_t, s_s_e, s_i_t, s_i_k, KP)
    if NORMALIZE:
        s = s / (tl.sum(s, axis=1) + eps)[:, None]
    ks = tl.arange(0, KP)
    ok = (rows < T)[:, None] & (ks < K)[None, :]
    rows = rows.to(tl.int64)
    out = (s * scale).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[:, None] * s_o_t + ks[None, :] * s_o_k, out, mask=ok)


@triton.jit
def _replay_bwd(
    scores_ptr, idx_ptr, g_ptr, grad_ptr,
    T, E, K, scale, eps,
    s_s_t, s_s_e, s_i_t, s_i_k, s_g_t, s_g_k, s_d_t, s_d_e,
    NORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, KP: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    idx, s = _gather_rows(scores_ptr, idx_ptr, rows, T, E, K, s_s_t, s_s_e, s_i_t, s_i_k, KP)
    ks = tl.arange(0, KP)
    ok = (rows < T)[:, None] & (ks < K)[None, :]
    rows = rows.to(tl.int64)
    g = tl.load(g_ptr + rows[:, None] * s_g_t + ks[None, :] * s_g_k, mask=ok, other=0.0)
    g = g.to(tl.float32)
    if NORMALIZE:
        inv = 1.0 / (tl.sum(s, axis=1) + eps)
        gs = tl.sum(g * s, axis=1)
        ds = scale * (g - (gs * inv)[:, None]) * inv[:, None]
    else:
        ds = scale * g
    hit = idx[:, :, None] == cols[None, None, :]  # [BLOCK_T, KP, BLOCK_E]
    grad = tl.sum(tl.where(hit, ds[:, :, None], 0.0), axis=1)
    tl.store(
        grad_ptr + rows[:, None] * s_d_t + cols[None, :] * s_d_e,
        grad.to(grad_ptr.dtype.element_ty),
        mask=(rows < T)[:, None] & (cols < E)[None, :],
    )


def _blocks() -> dict[str, int]:
    if interpreting():
        return {"t_fwd": 16, "t_bwd": 16, "e": 32}
    return {"t_fwd": 128, "t_bwd": 16, "e": 64}


class _ReplayGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores_TE, idx_TK, normalize, scale, eps):  # type: ignore[no-untyped-def]
        tokens, experts = scores_TE.shape
        topk = idx_TK.shape[1]
        probs_TK = scores_TE.new_empty(tokens, topk)
        bl = _blocks()
        kp = triton.next_power_of_2(max(topk, 1))
        if tokens:
            _replay_fwd[(triton.cdiv(tokens, bl["t_fwd"]),)](
                scores_TE, idx_TK, probs_TK,
                tokens, experts, topk, scale, eps,
                *scores_TE.stride(), *idx_TK.stride(), *probs_TK.stride(),
                NORMALIZE=normalize, BLOCK_T=bl["t_fwd"], KP=kp,
            )  # fmt: skip
        ctx.save_for_backward(scores_TE, idx_TK)
        ctx.args = normalize, scale, eps
        return probs_TK

    @staticmethod
    def backward(ctx, g_TK):  # type: ignore[no-untyped-def]
        scores_TE, idx_TK = ctx.saved_tensors
        normalize, scale, eps = ctx.args
        tokens, experts = scores_TE.shape
        topk = idx_TK.shape[1]
        grad_TE = torch.empty_like(scores_TE, memory_format=torch.contiguous_format)
        bl = _blocks()
        if tokens:
            grid = (triton.cdiv(tokens, bl["t_bwd"]), triton.cdiv(experts, bl["e"]))
            _replay_bwd[grid](
                scores_TE, idx_TK, g_TK, grad_TE,
                tokens, experts, topk, scale, eps,
                *scores_TE.stride(), *idx_TK.stride(), *g_TK.stride(), *grad_TE.stride(),
                NORMALIZE=normalize, BLOCK_T=bl["t_bwd"], BLOCK_E=bl["e"],
                KP=triton.next_power_of_2(max(topk, 1)),
            )  # fmt: skip
        return grad_TE, None, None, None, None


def replay_gather_triton(
    scores_TE: torch.Tensor, idx_TK: torch.Tensor, normalize: bool, scale: float, eps: float
) -> torch.Tensor:
    return _ReplayGather.apply(scores_TE, idx_TK, normalize, scale, eps)
