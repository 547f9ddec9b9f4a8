"""moerl.models.grouped_experts.grouped_linear: both backward paths (torch's grouped
backward for small experts, GroupedLinear's per-expert weight gradients for larger
ones) give bitwise the results and gradients of one plain GEMM per expert on CPU."""

from __future__ import annotations

import pytest
import torch

from moerl.models import grouped_experts
from moerl.models.grouped_experts import NATIVE_BACKWARD_MAX_WEIGHT, grouped_linear


@pytest.mark.parametrize("out_in", [(64, 32), (128, 96)])  # below / above the threshold
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_linear_is_bitwise_one_gemm_per_expert(out_in, dtype):
    out_f, in_f = out_in
    assert (out_f * in_f > NATIVE_BACKWARD_MAX_WEIGHT) == (out_in == (128, 96))
    gen = torch.Generator().manual_seed(0)
    counts = [5, 0, 17, 3, 9, 1, 0, 30]  # two experts without tokens
    x = torch.randn(sum(counts), in_f, generator=gen).to(dtype)
    weights = [torch.randn(out_f, in_f, generator=gen).to(dtype) for _ in counts]
    grad = torch.randn(sum(counts), out_f, generator=gen).to(dtype)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)

    def run(fn):  # type: ignore[no-untyped-def]
        xs, ws = x.clone().requires_grad_(), [w.clone().requires_grad_() for w in weights]
        y = fn(xs, ws)
        y.backward(grad)
        return y.detach(), xs.grad, [w.grad for w in ws]

    want = run(lambda xs, ws: torch.cat([c @ w.t() for c, w in zip(torch.split(xs, counts), ws)]))
    got = run(lambda xs, ws: grouped_linear(xs, offs, counts, ws))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert all(torch.equal(a, b) for a, b in zip(got[2], want[2]))
    assert not got[2][1].any()  # an expert without tokens gets a zero gradient


def test_a_broadcast_gradient_reaches_the_small_path():
    """sum().backward() hands a stride-0 gradient, which torch's grouped backward refuses."""
    x = torch.randn(6, 16, requires_grad=True)
    weights = [torch.randn(16, 16, requires_grad=True) for _ in range(2)]
    offs = torch.tensor([2, 6], dtype=torch.int32)
    grouped_linear(x, offs, [2, 4], weights).sum().backward()
    want = torch.cat([w.detach().sum(0).expand(n, 16) for w, n in zip(weights, [2, 4])])
    assert torch.allclose(x.grad, want, atol=1e-5)  # a sum in another order than the GEMM's
    assert grouped_experts.grouped_mm_fn() is not None
