"""The routing-replay gather: twin vs megatron-core's router, kernel vs twin.

The twin must be megatron's own formula, so it is checked bitwise against
``topk_routing_with_score_function`` with a ``RouterReplay`` replaying the same experts
(sigmoid with renormalisation and scaling, top-1 sigmoid, pre-softmax), forward and
gradient to the logits. The Triton kernel is checked against the twin on ragged shapes.
"""

# T tokens, E experts, K top-k

from __future__ import annotations

import pytest
import torch

from moerl.device import has_cuda
from moerl.kernels.dispatch import backend, triton_available
from moerl.kernels.replay_gather import replay_gather

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")

# (T, E, K): E=1/K=1, K=E, T and E off the block sizes, one token
SHAPES = [(37, 16, 4), (5, 1, 1), (20, 8, 8), (1, 300, 8), (50, 33, 1), (0, 8, 2)]


def _inputs(t, e, k, dtype=torch.float32, device="cpu", seed=0):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    scores_TE = torch.rand(t, e, generator=gen)  # sigmoid outputs: positive
    idx_TK = torch.argsort(torch.rand(t, e, generator=gen), dim=1)[:, :k]  # distinct experts
    g_TK = torch.randn(t, k, generator=gen)
    return scores_TE.to(device, dtype), idx_TK.to(device), g_TK.to(device, dtype)


def _run(name, scores_TE, idx_TK, g_TK, **kw):  # type: ignore[no-untyped-def]
    leaf = scores_TE.detach().clone().requires_grad_(True)
    with backend(name):
        probs_TK = replay_gather(leaf, idx_TK, **kw)
    (grad_TE,) = torch.autograd.grad(probs_TK, leaf, g_TK)
    return probs_TK.detach(), grad_TE


def _megatron(logits_TE, idx_TK, **kw):  # type: ignore[no-untyped-def]
    """megatron-core's dense routing probs with a RouterReplay forcing ``idx_TK``."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    replay = RouterReplay()
    try:
        replay.set_target_indices(idx_TK)
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        probs_TE, _ = topk_routing_with_score_function(
            logits_TE, idx_TK.shape[1], router_replay=replay, **kw
        )
    finally:  # megatron keeps every instance in a global list
        RouterReplay.global_router_replay_instances.remove(replay)
    return probs_TE


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "k,router,ours",
    [
        (4, dict(score_function="sigmoid", scaling_factor=2.5), dict(normalize=True, scale=2.5)),
        (1, dict(score_function="sigmoid"), dict(normalize=True)),  # top-1: no renormalising
        (
            3,
            dict(score_function="softmax", use_pre_softmax=True, scaling_factor=1.5),
            dict(normalize=False, scale=1.5),
        ),
    ],
)
def test_twin_is_megatron(dtype, k, router, ours):
    gen = torch.Generator().manual_seed(0)
    logits_TE = torch.randn(9, 12, generator=gen).to(dtype)
    idx_TK = torch.argsort(torch.rand(9, 12, generator=gen), dim=1)[:, :k]
    g_TE = torch.randn(9, 12, generator=gen).to(dtype)

    ref = logits_TE.clone().requires_grad_(True)
    want_TE = _megatron(ref, idx_TK, **router)
    (want_grad,) = torch.autograd.grad(want_TE, ref, g_TE)

    mine = logits_TE.clone().requires_grad_(True)
    if router["score_function"] == "sigmoid":  # the scores megatron gathers from
        scores_TE = torch.sigmoid(mine.float()).type_as(mine)
    else:
        scores_TE = torch.softmax(mine, dim=-1, dtype=torch.float32).type_as(mine)
    with backend("torch"):
        probs_TK = replay_gather(scores_TE, idx_TK, **ours)
    got_TE = torch.zeros_like(mine).scatter(1, idx_TK, probs_TK)
    (got_grad,) = torch.autograd.grad(got_TE, mine, g_TE)
    assert torch.equal(got_TE, want_TE)
    assert torch.equal(got_grad, want_grad)


@needs_triton
@pytest.mark.parametrize("t,e,k", SHAPES)
@pytest.mark.parametrize("normalize,scale", [(True, 2.5), (False, 1.0)])
def test_kernel_matches_twin_fp32(t, e, k, normalize, scale):
    inputs = _inputs(t, e, k)
    got = _run("triton", *inputs, normalize=normalize, scale=scale)
    want = _run("torch", *inputs, normalize=normalize, scale=scale)
    for u, v in zip(got, want):
        torch.testing.assert_close(u, v, rtol=1e-6, atol=1e-6)


def _check_bf16(inputs, got, want, **kw):  # type: ignore[no-untyped-def]
    """The twin rounds to bf16 after every op, the kernel once at the end: they differ by
    bf16 ulps of the largest value, and the kernel is as close as the twin to fp64."""
    scores_TE, idx_TK, g_TK = inputs
    exact = _run("torch", scores_TE.double(), idx_TK, g_TK.double(), **kw)
    for u, v, x in zip(got, want, exact):
        assert u.dtype == v.dtype == torch.bfloat16
        size = x.abs().max().item()
        assert (u.double() - v.double()).abs().max().item() <= 2e-2 * size
        err_kernel = (u.double() - x).abs().max().item()
        err_twin = (v.double() - x).abs().max().item()
        assert err_kernel <= err_twin + 2**-8 * size


@needs_triton
@pytest.mark.parametrize("t,e,k", SHAPES[:4])
def test_kernel_matches_twin_bf16(t, e, k):
    inputs = _inputs(t, e, k, torch.bfloat16)
    kw = dict(normalize=True, scale=2.5)
    _check_bf16(inputs, _run("triton", *inputs, **kw), _run("torch", *inputs, **kw), **kw)


@needs_triton
def test_kernel_strided_scores_int32_and_repeated_indices():
    """Transposed scores, int32 indices, and a repeated expert in a row: the gradient sums
    both slots like ``gather``'s backward."""
    scores_ET = torch.rand(10, 7)
    idx_TK = torch.tensor([[1, 1, 4], [0, 9, 2], [9, 9, 9]] + [[3, 5, 6]] * 4, dtype=torch.int32)
    g_TK = torch.randn(7, 3)
    got = _run("triton", scores_ET.t(), idx_TK, g_TK, normalize=True, scale=1.0)
    want = _run("torch", scores_ET.t(), idx_TK, g_TK, normalize=True, scale=1.0)
    for u, v in zip(got, want):
        torch.testing.assert_close(u, v, rtol=1e-6, atol=1e-6)


def test_bad_inputs_are_reported():
    scores_TE, idx_TK, _ = _inputs(4, 6, 2)
    with pytest.raises(ValueError, match="indices"):
        replay_gather(scores_TE, idx_TK[:3], normalize=True)
    with pytest.raises(ValueError, match="integers"):
        replay_gather(scores_TE, idx_TK.float(), normalize=True)


@pytest.mark.gpu
@pytest.mark.skipif(not has_cuda(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_twin_gpu_size(dtype):
    """32K tokens × 256 experts × top-8."""
    inputs = _inputs(32768, 256, 8, dtype, "cuda")
    got = _run("triton", *inputs, normalize=True, scale=2.5)
    want = _run("torch", *inputs, normalize=True, scale=2.5)
    if dtype == torch.bfloat16:
        _check_bf16(inputs, got, want, normalize=True, scale=2.5)
        return
    for u, v in zip(got, want):  # GPU division is not IEEE-rounded in Triton
        torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-5)
