"""Triton segment GEMMs for the per-expert LoRA delta (see ``lora_gmm.py``).

Two kernels cover all six products of the forward and backward:

- ``_segment_mm``: ``out[t] = scale · in[t] W_e`` for the tokens t of expert e. A
  program owns one (expert, token block) tile and one block of output columns; tiles
  are numbered expert by expert (``ceil(count_e / BLOCK_T)`` each) and a program finds
  its expert from the cumulative tile counts, so no host sync is needed and the grid is
  the bound ``ceil(T / BLOCK_T) + E`` (spare programs return at once). Used for
  ``h = x Aᵀ`` and ``dh = scaling · g B`` (long reduction, r outputs) and for
  ``y = scaling · h Bᵀ`` and ``dx = dh A`` (rank-r reduction, long outputs).
- ``_segment_outer``: ``out[e] = scale · Σ_t p[t]ᵀ q[t]`` over expert e's tokens, for
  ``dA = dhᵀ x`` and ``dB = scaling · gᵀ h``. A program owns one (expert, row block,
  column block) of the weight gradient and walks the expert's tokens, so an expert with
  no tokens writes zeros, and the sum is deterministic (no atomics).

Accumulation is fp32; fp32 inputs multiply in IEEE fp32 (not TF32) so the kernel
matches the twin tightly. Triton 3's CPU interpreter miscomputes ``tl.dot`` on bf16
operands, so under ``TRITON_INTERPRET=1`` operands are upcast to fp32 first (exact:
a bf16 product fits in fp32).
"""

# T tokens (grouped by expert), E experts, I in features, O out features, r rank

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moerl.kernels.dispatch import interpreting


@triton.jit
def _dot(a, b, acc, FP32_DOT: tl.constexpr):
    if FP32_DOT:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _segment_mm(
    in_ptr, w_ptr, out_ptr, offsets_ptr, tile_cum_ptr,
    K, N, scale,
    s_in_t, s_in_k, s_w_e, s_w_k, s_w_n, s_out_t, s_out_n,
    E: tl.constexpr, EP: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    FP32_DOT: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    experts = tl.arange(0, EP)
    tile_cum = tl.load(tile_cum_ptr + experts, mask=experts < E, other=2**30)
    e = tl.sum((tile_cum <= tile).to(tl.int32), axis=0)  # experts whose tiles end before
    if e >= E:
        return
    first_tile = tl.load(tile_cum_ptr + e - 1, mask=e > 0, other=0)
    start = tl.load(offsets_ptr + e) + (tile - first_tile) * BLOCK_T
    end = tl.load(offsets_ptr + e + 1)
    rows = start + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < end
    col_ok = cols < N
    rows = rows.to(tl.int64)
    w_ptr += e.to(tl.int64) * s_w_e
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(
            in_ptr + rows[:, None] * s_in_t + ks[None, :] * s_in_k,
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + ks[:, None] * s_w_k + cols[None, :] * s_w_n,
            mask=k_ok[:, None] & col_ok[None, :],
            other=0.0,
        )
        acc = _dot(a, w, acc, FP32_DOT)
    out = (acc * scale).to(out_ptr.dtype.element_ty)
    tl.store(
        out_ptr + rows[:, None] * s_out_t + cols[None, :] * s_out_n,
        out,
        mask=row_ok[:, None] & col_ok[None, :],
    )


@triton.jit
def _segment_outer(
    p_ptr, q_ptr, out_ptr, offsets_ptr,
    M, N, scale,
    s_p_t, s_p_m, s_q_t, s_q_n, s_out_e, s_out_m, s_out_n,
    BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    FP32_DOT: tl.constexpr,
):  # fmt: skip
    e = tl.program_id(0)
    ms = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = ms < M
    n_ok = ns < N
    start = tl.load(offsets_ptr + e)
    end = tl.load(offsets_ptr + e + 1)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t0 in range(start, end, BLOCK_T):
        ts = t0 + tl.arange(0, BLOCK_T)
        t_ok = ts < end
        ts = ts.to(tl.int64)
        p_MT = tl.load(
            p_ptr + ts[None, :] * s_p_t + ms[:, None] * s_p_m,
            mask=m_ok[:, None] & t_ok[None, :],
            other=0.0,
        )
        q_TN = tl.load(
            q_ptr + ts[:, None] * s_q_t + ns[None, :] * s_q_n,
            mask=t_ok[:, None] & n_ok[None, :],
            other=0.0,
        )
        acc = _dot(p_MT, q_TN, acc, FP32_DOT)
    out = (acc * scale).to(out_ptr.dtype.element_ty)
    tl.store(
        out_ptr + e.to(tl.int64) * s_out_e + ms[:, None] * s_out_m + ns[None, :] * s_out_n,
        out,
        mask=m_ok[:, None] & n_ok[None, :],
    )


def _blocks() -> dict[str, int]:
    """Tile sizes: GPU ones for bandwidth, small ones in the interpreter (each program
    is Python there) so tests stay fast and still cross block edges."""
    if interpreting():
        return {"t": 16, "k": 32, "n": 32, "warps": 4, "stages": 1}
    return {"t": 64, "k": 64, "n": 128, "warps": 4, "stages": 3}


class _Plan:
    """Where each expert's segment starts, and its token tiles, computed on the device."""

    def __init__(self, counts_E: torch.Tensor, tokens: int, rank: int, device: torch.device):
        bl = _blocks()
        self.block_t = bl["t"]
        self.warps, self.stages = bl["warps"], bl["stages"]
        self.block_k, self.block_n = bl["k"], bl["n"]
        self.rank_block = max(16, triton.next_power_of_2(rank))  # tl.dot needs ≥ 16
        counts_E = counts_E.to(device=device, dtype=torch.int32, non_blocking=True)
        self.experts = counts_E.shape[0]
        self.offsets_E1 = torch.zeros(self.experts + 1, dtype=torch.int32, device=device)
        self.offsets_E1[1:] = torch.cumsum(counts_E, 0)
        tiles_E = (counts_E + self.block_t - 1) // self.block_t
        self.tile_cum_E = torch.cumsum(tiles_E, 0, dtype=torch.int32)
        self.max_tiles = triton.cdiv(tokens, self.block_t) + self.experts
        self.fp32_dot = interpreting()

    def mm(self, in_TK, w, w_strides, out_TN, scale, *, long_k: bool) -> torch.Tensor:
        """``out = scale · in W_e`` per segment; ``w_strides`` = (expert, k, n) strides of W.
        ``long_k``: K is a feature dim (blocked), else the rank (one padded block)."""
        k, n = in_TK.shape[1], out_TN.shape[1]
        block_k = self.block_k if long_k else self.rank_block
        block_n = self.rank_block if long_k else self.block_n
        grid = (self.max_tiles, triton.cdiv(n, block_n))
        _segment_mm[grid](
            in_TK, w, out_TN, self.offsets_E1, self.tile_cum_E,
            k, n, scale,
            in_TK.stride(0), in_TK.stride(1), *w_strides, out_TN.stride(0), out_TN.stride(1),
            E=self.experts, EP=triton.next_power_of_2(self.experts),
            BLOCK_T=self.block_t, BLOCK_K=block_k, BLOCK_N=block_n,
            FP32_DOT=self.fp32_dot or in_TK.dtype == torch.float32,
            num_warps=self.warps, num_stages=self.stages,
        )  # fmt: skip
        return out_TN

    def outer(self, p_TM, q_TN, out_EMN, scale) -> torch.Tensor:
        """``out[e] = scale · p[seg e]ᵀ q[seg e]``; one of M, N is the rank."""
        m, n = p_TM.shape[1], q_TN.shape[1]
        block_m = self.rank_block if m <= self.rank_block else self.block_n
        block_n = self.rank_block if n <= self.rank_block else self.block_n
        grid = (self.experts, triton.cdiv(m, block_m), triton.cdiv(n, block_n))
        _segment_outer[grid](
            p_TM, q_TN, out_EMN, self.offsets_E1,
            m, n, scale,
            p_TM.stride(0), p_TM.stride(1), q_TN.stride(0), q_TN.stride(1),
            out_EMN.stride(0), out_EMN.stride(1), out_EMN.stride(2),
            BLOCK_T=self.block_t, BLOCK_M=block_m, BLOCK_N=block_n,
            FP32_DOT=self.fp32_dot or p_TM.dtype == torch.float32,
            num_warps=self.warps, num_stages=self.stages,
        )  # fmt: skip
        return out_EMN


def _strides(w: torch.Tensor, transpose: bool) -> tuple[int, int, int]:
    """(expert, k, n) strides of W_e = w[e] (or w[e]ᵀ), the operand of ``_Plan.mm``."""
    s_e, s_0, s_1 = w.stride()
    return (s_e, s_1, s_0) if transpose else (s_e, s_0, s_1)


class _LoraGrouped(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TI, a_ErI, b_EOr, counts_E, scaling):  # type: ignore[no-untyped-def]
        tokens, rank = x_TI.shape[0], a_ErI.shape[1]
        plan = _Plan(counts_E, tokens, rank, x_TI.device)
        h_Tr = x_TI.new_empty(tokens, rank)
        plan.mm(x_TI, a_ErI, _strides(a_ErI, True), h_Tr, 1.0, long_k=True)
        y_TO = x_TI.new_empty(tokens, b_EOr.shape[1])
        plan.mm(h_Tr, b_EOr, _strides(b_EOr, True), y_TO, scaling, long_k=False)
        ctx.save_for_backward(x_TI, a_ErI, b_EOr, h_Tr)
        ctx.plan, ctx.scaling = plan, scaling
        return y_TO

    @staticmethod
    def backward(ctx, g_TO):  # type: ignore[no-untyped-def]
        x_TI, a_ErI, b_EOr, h_Tr = ctx.saved_tensors
        plan, scaling = ctx.plan, ctx.scaling
        need_x, need_a, need_b = ctx.needs_input_grad[:3]
        dx_TI = da_ErI = db_EOr = None
        if need_x or need_a:
            dh_Tr = h_Tr.new_empty(h_Tr.shape)  # scaling · g B_e
            plan.mm(g_TO, b_EOr, _strides(b_EOr, False), dh_Tr, scaling, long_k=True)
            if need_x:  # dh A_e
                dx_TI = x_TI.new_empty(x_TI.shape)
                plan.mm(dh_Tr, a_ErI, _strides(a_ErI, False), dx_TI, 1.0, long_k=False)
            if need_a:  # dhᵀ x per segment
                da_ErI = plan.outer(dh_Tr, x_TI, torch.empty_like(a_ErI), 1.0)
        if need_b:  # scaling · gᵀ h per segment
            db_EOr = plan.outer(g_TO, h_Tr, torch.empty_like(b_EOr), scaling)
        return dx_TI, da_ErI, db_EOr, None, None


def lora_grouped_triton(
    x_TI: torch.Tensor,
    a_ErI: torch.Tensor,
    b_EOr: torch.Tensor,
    counts_E: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    return _LoraGrouped.apply(x_TI, a_ErI, b_EOr, counts_E, scaling)
