"""The matrix products ``kernels/batch_invariant.py`` builds its ops from.

The batch-invariant ops need a product in which an element's sum is the same sequence
of operations whatever the batch around it. On the CPU torch's own products give that
for the fixed tile shapes those ops use (measured with MKL, tested by
tests/unit/test_batch_invariant.py), so ``bmm`` and ``mm`` are ``torch.bmm`` and
``torch.mm`` there: the torch twin. On CUDA they do not: cuBLAS picks its kernel from
the batch count and the shapes, and on an H200 a row got other bits once the batch held
16 or more tiles (tools/gpu/probe_invariance.py). There, with Triton, the products run
one kernel of one fixed configuration (``tile_product_triton.py``: fixed blocks, K
walked in order, fp32 accumulation, no TF32, no split-K), whose element results depend
on the element's row, column and K alone. Its backward is torch's products (gradients
need not be batch-invariant). ``dispatch``'s backend chooses as for every kernel here
(``MOERL_KERNELS``: ``torch`` keeps cuBLAS on CUDA).
"""

# B batch entries, M rows, K inner dim, N columns

from __future__ import annotations

from typing import Any

import torch

from moerl.kernels.dispatch import use_triton


class _Bmm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, a_BMK: torch.Tensor, b_BKN: torch.Tensor) -> torch.Tensor:
        from moerl.kernels.tile_product_triton import bmm as triton_bmm

        ctx.save_for_backward(a_BMK, b_BKN)
        return triton_bmm(a_BMK, b_BKN)

    @staticmethod
    def backward(ctx: Any, g_BMN: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        a_BMK, b_BKN = ctx.saved_tensors
        g_a = torch.bmm(g_BMN, b_BKN.transpose(1, 2)) if ctx.needs_input_grad[0] else None
        g_b = torch.bmm(a_BMK.transpose(1, 2), g_BMN) if ctx.needs_input_grad[1] else None
        return g_a, g_b


def bmm(a_BMK: torch.Tensor, b_BKN: torch.Tensor) -> torch.Tensor:
    """``torch.bmm(a, b)``, by the fixed-configuration kernel where ``use_triton``."""
    if a_BMK.dtype != b_BKN.dtype:
        raise TypeError(f"tile_product.bmm: {a_BMK.dtype} × {b_BKN.dtype}; cast one first")
    if use_triton(a_BMK, b_BKN):
        out: torch.Tensor = _Bmm.apply(a_BMK, b_BKN)
        return out
    return torch.bmm(a_BMK, b_BKN)


def mm(a_MK: torch.Tensor, b_KN: torch.Tensor) -> torch.Tensor:
    """``torch.mm(a, b)``, by the fixed-configuration kernel where ``use_triton``."""
    if use_triton(a_MK, b_KN):
        return bmm(a_MK[None], b_KN[None])[0]
    return torch.mm(a_MK, b_KN)
