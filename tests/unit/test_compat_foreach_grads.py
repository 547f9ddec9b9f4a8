"""moerl/compat/megatron_patches.py ``foreach_grad_norm_and_scale``: without TE or apex,
megatron-core's gradient norm and scaling run its ``megatron.core.utils`` fallbacks
(the independent reference here); the foreach replacements give the same bits."""

from __future__ import annotations

import pytest
import torch
from megatron.core import utils

from moerl.compat.megatron_patches import _foreach_l2_norm, _foreach_scale


def _grads(dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (129,), (3, 4, 8), (1,), (64, 33)]
    return [(torch.randn(s, generator=gen) * 10 ** (i - 2)).to(dtype) for i, s in enumerate(shapes)]


def _reference_norm(lists: list[list[torch.Tensor]]) -> torch.Tensor:
    """megatron's fallback, whose result it places on "cuda": here the CPU."""
    from moerl.compat.device_mode import CudaToCpuMode

    with CudaToCpuMode():
        got, _ = utils.local_multi_tensor_l2_norm(2048 * 32, None, lists, False)
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_norm_is_the_fallbacks_bit_for_bit(dtype):
    lists = [_grads(dtype) + _grads(dtype, seed=1)]  # megatron passes one list
    want = _reference_norm(lists)
    got, none = _foreach_l2_norm(2048 * 32, None, lists, False)
    assert none is None and got.dtype == torch.float32 and got.shape == (1,)
    assert torch.equal(got, want.cpu()), (got, want)


def test_the_norm_of_mixed_dtypes_and_of_nothing():
    lists = [_grads(torch.float32) + _grads(torch.bfloat16, seed=2)]
    assert torch.equal(_foreach_l2_norm(0, None, lists, False)[0], _reference_norm(lists).cpu())
    assert torch.equal(_foreach_l2_norm(0, None, [[]], False)[0], torch.zeros(1))


@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("scale", [0.3, torch.tensor(0.7)])
def test_scaling_is_the_fallbacks_bit_for_bit(in_place, scale):
    src = _grads(torch.float32)
    want_src = [t.clone() for t in src]
    want_dst = want_src if in_place else [torch.empty_like(t) for t in src]
    utils.local_multi_tensor_scale(0, None, [want_src, want_dst], scale)
    dst = src if in_place else [torch.empty_like(t) for t in src]
    _foreach_scale(0, None, [src, dst], scale)
    assert all(torch.equal(a, b) for a, b in zip(dst, want_dst))
    if not in_place:  # the sources are left as they were
        assert all(torch.equal(a, b) for a, b in zip(src, _grads(torch.float32)))


def test_the_sites_are_patched_where_the_fallbacks_are_used():
    from megatron.core.optimizer import clip_grads, optimizer

    from moerl import compat

    compat.activate()
    if clip_grads.l2_norm_impl is not _foreach_l2_norm:  # TE or apex present: left alone
        assert clip_grads.l2_norm_impl is not utils.local_multi_tensor_l2_norm
        pytest.skip("transformer-engine or apex provides the multi-tensor kernels")
    assert clip_grads.multi_tensor_scale_impl is _foreach_scale
    assert optimizer.multi_tensor_scale_impl is _foreach_scale


@pytest.fixture
def world_of_one(tmp_path):  # type: ignore[no-untyped-def]
    """A gloo group of this process alone: the norm all-reduces over it, as on one rank."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def originals(monkeypatch):  # type: ignore[no-untyped-def]
    """megatron-core's own norm and clipping, with its own fallbacks, under the CPU mode:
    the reference (compat.activate() elsewhere in this process may have replaced them)."""
    from megatron.core.optimizer import clip_grads

    from moerl.compat.device_mode import CudaToCpuMode

    monkeypatch.setattr(clip_grads, "l2_norm_impl", utils.local_multi_tensor_l2_norm)
    monkeypatch.setattr(clip_grads, "multi_tensor_scale_impl", utils.local_multi_tensor_scale)

    def under_mode(fn):  # type: ignore[no-untyped-def]
        def run(*args, **kwargs):  # type: ignore[no-untyped-def]
            with CudaToCpuMode():
                return fn(*args, **kwargs)

        return run

    return under_mode(clip_grads.get_grad_norm_fp32), under_mode(
        clip_grads.clip_grad_by_total_norm_fp32
    )


def test_the_grad_norm_is_megatrons_bit_for_bit(world_of_one, originals):
    from megatron.core.optimizer import clip_grads

    from moerl.compat.megatron_patches import _grad_norm_fp32

    original_norm, _ = originals
    ours = _grad_norm_fp32(clip_grads.get_grad_norm_fp32)
    grads = _grads(torch.float32)
    assert ours(grads) == original_norm(grads)
    assert ours(grads[1]) == original_norm(grads[1])  # one tensor
    assert ours([]) == original_norm([]) == 0.0
    assert ours(grads, norm_type=float("inf")) == max(float(g.abs().max()) for g in grads)


@pytest.mark.parametrize("max_norm", [1e9, 0.5])  # no clipping; clipping
@pytest.mark.parametrize("decoupled", [False, True])
def test_clipping_is_megatrons_bit_for_bit(world_of_one, originals, max_norm, decoupled):
    from megatron.core.optimizer import clip_grads

    from moerl.compat.megatron_patches import _clip_grad_by_total_norm_fp32

    original_norm, original_clip = originals
    ours = _clip_grad_by_total_norm_fp32(clip_grads.clip_grad_by_total_norm_fp32)
    field = "decoupled_grad" if decoupled else "grad"

    def params():  # type: ignore[no-untyped-def]
        made = [torch.nn.Parameter(torch.zeros_like(g)) for g in _grads(torch.float32)]
        for p, g in zip(made, _grads(torch.float32)):
            setattr(p, field, g)
        made.append(torch.nn.Parameter(torch.zeros(3)))  # no gradient: left out
        return made

    want, got = params(), params()
    norm = original_norm([getattr(p, field) for p in want[:-1]])
    original_clip(want, max_norm, norm, decoupled)
    ours(got, max_norm, norm, decoupled)
    for a, b in zip(got[:-1], want[:-1]):
        assert torch.equal(getattr(a, field), getattr(b, field))
    scaled = not torch.equal(getattr(want[0], field), _grads(torch.float32)[0])
    assert scaled == (max_norm < norm)


def test_clipping_refuses_gradients_megatron_refuses():
    from megatron.core.optimizer import clip_grads

    from moerl.compat.megatron_patches import _clip_grad_by_total_norm_fp32

    ours = _clip_grad_by_total_norm_fp32(clip_grads.clip_grad_by_total_norm_fp32)
    param = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    param.grad = torch.ones(4, dtype=torch.bfloat16)
    with pytest.raises(AssertionError, match="bfloat16"):
        ours([param], 0.1, 10.0)
