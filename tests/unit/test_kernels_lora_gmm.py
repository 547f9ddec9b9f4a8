"""The per-expert LoRA grouped matmul: twin vs a dense reference, kernel vs twin.

The twin (a loop over experts) is checked against an independent formulation in fp64:
every token gathers its own expert's A and B and the products are einsums. The Triton
kernel (CPU interpreter here, the GPU with ``-m gpu``) is checked against the twin,
forward and all three gradients, on ragged segments: empty experts, one-token experts,
lengths off the block size, one expert, ranks 4..64, feature dims off the block size.
"""

# T tokens (grouped by expert), E experts, I in features, O out features, r rank

from __future__ import annotations

import pytest
import torch

from moerl.device import has_cuda
from moerl.kernels.dispatch import backend, triton_available
from moerl.kernels.lora_gmm import lora_grouped

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")

# (tokens per expert, I, O, r)
RAGGED = [
    ([5, 0, 17, 1, 33], 48, 40, 4),  # empty and one-token experts, rows off the block
    ([23], 20, 36, 8),  # a single expert
    ([0, 0, 19, 0], 33, 17, 16),  # all tokens on one expert, the others empty
    ([16, 3, 40], 24, 70, 64),  # the largest rank
    ([0, 0, 0], 12, 8, 4),  # no tokens at all
]


def _inputs(counts, i, o, r, dtype=torch.float32, device="cpu", seed=0):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    e, t = len(counts), sum(counts)
    x_TI = torch.randn(t, i, generator=gen)
    a_ErI = torch.randn(e, r, i, generator=gen) / i**0.5
    b_EOr = torch.randn(e, o, r, generator=gen) / r**0.5
    g_TO = torch.randn(t, o, generator=gen)
    return [v.to(device=device, dtype=dtype) for v in (x_TI, a_ErI, b_EOr, g_TO)]


def _run(name, x_TI, a_ErI, b_EOr, g_TO, counts, scaling):  # type: ignore[no-untyped-def]
    """Output and (dx, dA, dB) under one backend."""
    leaves = [v.detach().clone().requires_grad_(True) for v in (x_TI, a_ErI, b_EOr)]
    with backend(name):
        y_TO = lora_grouped(*leaves, torch.tensor(counts), scaling)
    grads = torch.autograd.grad(y_TO, leaves, g_TO, allow_unused=True)
    return [y_TO.detach(), *grads]


def _dense(x_TI, a_ErI, b_EOr, counts, scaling):  # type: ignore[no-untyped-def]
    expert_T = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    h_Tr = torch.einsum("ti,tri->tr", x_TI, a_ErI[expert_T])
    return scaling * torch.einsum("tr,tor->to", h_Tr, b_EOr[expert_T])


def _close(got, want, rel):  # type: ignore[no-untyped-def]
    """|got - want| ≤ rel · max|want| elementwise (bf16 errors scale with the magnitude)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    if want.numel():
        bound = rel * max(want.float().abs().max().item(), 1e-6)
        err = (got.float() - want.float()).abs().max().item()
        assert err <= bound, f"max error {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("counts,i,o,r", RAGGED)
def test_twin_matches_dense_reference(counts, i, o, r):
    x_TI, a_ErI, b_EOr, g_TO = _inputs(counts, i, o, r, torch.float64)
    got = _run("torch", x_TI, a_ErI, b_EOr, g_TO, counts, 0.7)
    leaves = [v.clone().requires_grad_(True) for v in (x_TI, a_ErI, b_EOr)]
    want_TO = _dense(*leaves, counts, 0.7)
    want = [want_TO.detach(), *torch.autograd.grad(want_TO, leaves, g_TO)]
    for name, u, v in zip(("y", "dx", "dA", "dB"), got, want):
        torch.testing.assert_close(u, v, rtol=1e-10, atol=1e-10, msg=name)


@needs_triton
@pytest.mark.parametrize("counts,i,o,r", RAGGED)
def test_kernel_matches_twin_fp32(counts, i, o, r):
    inputs = _inputs(counts, i, o, r)
    got = _run("triton", *inputs, counts, 2.0)
    want = _run("torch", *inputs, counts, 2.0)
    for name, u, v in zip(("y", "dx", "dA", "dB"), got, want):
        torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-5, msg=name)
    for e, count in enumerate(counts):
        if count == 0:  # an empty expert's gradients are written, and exactly zero
            assert not got[2][e].any() and not got[3][e].any()


@needs_triton
@pytest.mark.parametrize("counts,i,o,r", RAGGED[:4])
def test_kernel_matches_twin_bf16(counts, i, o, r):
    inputs = _inputs(counts, i, o, r, torch.bfloat16)
    got = _run("triton", *inputs, counts, 0.5)
    want = _run("torch", *inputs, counts, 0.5)
    for u, v in zip(got, want):
        _close(u, v, rel=2e-2)


@needs_triton
def test_kernel_strided_inputs_and_partial_grads():
    """Row-strided x (a slice of a wider buffer), a stride-0 upstream gradient, and a
    frozen x (only the adapters train): the kernel reads strides and skips dx."""
    counts, i, o, r = [7, 0, 12], 20, 24, 8
    x_TI, a_ErI, b_EOr, _ = _inputs(counts, i, o, r)
    wide = torch.cat([x_TI, torch.randn_like(x_TI)], dim=1)
    outs = {}
    for name in ("triton", "torch"):
        a, b = a_ErI.clone().requires_grad_(True), b_EOr.clone().requires_grad_(True)
        with backend(name):
            y_TO = lora_grouped(wide[:, :i], a, b, counts, 1.5)
        outs[name] = [y_TO.detach(), *torch.autograd.grad(y_TO.sum(), [a, b])]
    for u, v in zip(outs["triton"], outs["torch"]):
        torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-5)


def test_bad_inputs_are_reported():
    x_TI, a_ErI, b_EOr, _ = _inputs([2, 3], 8, 6, 4)
    with pytest.raises(ValueError, match="add up"):
        lora_grouped(x_TI, a_ErI, b_EOr, [2, 2], 1.0)
    with pytest.raises(ValueError, match="one count per expert"):
        lora_grouped(x_TI, a_ErI, b_EOr, [5], 1.0)
    with pytest.raises(ValueError, match="disagree"):
        lora_grouped(x_TI, a_ErI, b_EOr.transpose(1, 2), [2, 3], 1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not has_cuda(), reason="needs a CUDA GPU")
def test_kernel_matches_twin_gpu_size():
    """64 experts × hidden 4096 × rank 16 × 32K routed tokens, bf16, skewed segments."""
    gen = torch.Generator().manual_seed(1)
    weights = torch.rand(64, generator=gen) ** 3  # a few hot experts, some nearly idle
    expert_T = torch.multinomial(weights, 32768, replacement=True, generator=gen)
    counts = torch.bincount(expert_T, minlength=64)
    counts[5] = 0  # an empty expert (its tokens go to expert 6)
    counts[6] += 32768 - int(counts.sum())
    inputs = _inputs(counts.tolist(), 4096, 4096, 16, torch.bfloat16, "cuda")
    got = _run("triton", *inputs, counts.tolist(), 2.0)
    want = _run("torch", *inputs, counts.tolist(), 2.0)
    for u, v in zip(got, want):
        _close(u, v, rel=2e-2)
    assert not got[2][5].any() and not got[3][5].any()
