"""Triton kernel of ``tile_product``: a batched product of one fixed configuration.

A program owns one [BLOCK_M, BLOCK_N] block of one batch entry's output and walks K in
BLOCK_K chunks in order, ``tl.dot`` accumulating in fp32 (fp32 inputs in IEEE precision,
no TF32); the block is rounded to the inputs' dtype once. Rows past M, columns past N
and the K tail load zeros, which add nothing. No autotuning and no split-K: every
launch has the same block shape and warps, so an element's sum is the same sequence of
operations whatever the batch count, M, N or the element's place in its block.
Under ``TRITON_INTERPRET=1`` (Triton's CPU interpreter, the tests' way to run the kernel
without a GPU) a block's products are summed without ``tl.dot``: the interpreter hands a
dot to numpy's BLAS, which on some CPUs gives a row other bits by its place in the block
(OpenBLAS on an AVX-512 EPYC: 10 of 16 rows of a [16, 32] × [32, 32] product), and it
miscomputes bf16 operands. There each k-chunk's products are formed elementwise in fp32
and summed over k in order, so the interpreter keeps the kernel's promise on any CPU;
on a GPU the MMA units' own order is fixed by the block shape.
"""

# B batch entries, M rows, K inner dim, N columns

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moerl.kernels.dispatch import interpreting

BLOCK_M = 16
BLOCK_N = 64
BLOCK_K = 32
NUM_WARPS = 4


@triton.jit
def _bmm_kernel(
    a_ptr, b_ptr, c_ptr,
    M, N, K, m_blocks, n_blocks,
    s_ab, s_am, s_ak, s_bb, s_bk, s_bn, s_cb, s_cm, s_cn,
    IEEE: tl.constexpr, EXACT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)  # one flat grid: (batch, m block, n block)
    per_batch = m_blocks * n_blocks
    batch = (pid // per_batch).to(tl.int64)
    m_block = (pid % per_batch) // n_blocks
    n_block = pid % n_blocks
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_base = a_ptr + batch * s_ab + rows[:, None].to(tl.int64) * s_am
    b_base = b_ptr + batch * s_bb + cols[None, :].to(tl.int64) * s_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        a = tl.load(
            a_base + k[None, :] * s_ak, mask=(rows < M)[:, None] & (k < K)[None, :], other=0.0
        )
        b = tl.load(
            b_base + k[:, None] * s_bk, mask=(k < K)[:, None] & (cols < N)[None, :], other=0.0
        )
        if EXACT:  # the interpreter: products summed over k in order (module docstring)
            acc += tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
        elif IEEE:  # fp32 operands: no TF32
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    c = c_ptr + batch * s_cb + rows[:, None].to(tl.int64) * s_cm + cols[None, :] * s_cn
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=(rows < M)[:, None] & (cols < N)[None, :])


def bmm(a_BMK: torch.Tensor, b_BKN: torch.Tensor) -> torch.Tensor:
    """a [B, M, K] × b [B, K, N] → [B, M, N] in a's dtype (any strides, a stride-0 batch
    of b included)."""
    batch, m, k = a_BMK.shape
    n = b_BKN.shape[-1]
    out = a_BMK.new_empty(batch, m, n)
    if not out.numel():
        return out
    if not k:
        return out.zero_()
    m_blocks, n_blocks = triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N)
    _bmm_kernel[(batch * m_blocks * n_blocks,)](
        a_BMK, b_BKN, out, m, n, k, m_blocks, n_blocks,
        *a_BMK.stride(), *b_BKN.stride(), *out.stride(),
        IEEE=a_BMK.dtype == torch.float32, EXACT=interpreting(),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        num_warps=NUM_WARPS,
    )  # fmt: skip
    return out
