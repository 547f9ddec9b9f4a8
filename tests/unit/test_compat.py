"""moerl.compat: megatron-core's CUDA assumptions replaced on a CPU-only machine."""

from __future__ import annotations

import pytest
import torch

from moerl import compat

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the CPU layer is for CPU-only runs"
)


@pytest.fixture(autouse=True)
def active_compat():
    compat.activate()
    yield
    compat.activate()


def test_activate_keeps_cuda_unavailable():
    assert compat.is_active()
    assert torch.cuda.is_available() is False
    assert torch.cuda.current_device() == torch.device("cpu")


def test_streams_and_events_are_synchronous_noops():
    stream = torch.cuda.Stream()
    assert torch.cuda.current_stream() == stream
    with torch.cuda.stream(stream):
        x = torch.ones(3) * 2
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    end.record()
    assert end.elapsed_time(start) <= 0 <= start.elapsed_time(end)
    assert x.sum().item() == 6
    torch.cuda.synchronize()


def test_cuda_placements_become_cpu():
    a = torch.zeros(2, device="cuda")
    b = torch.tensor([1.0], device="cuda:0")
    c = torch.empty(3, device=torch.cuda.current_device())
    d = torch.ones(2).cuda()
    e = torch.ones(2).to("cuda")
    assert {t.device.type for t in (a, b, c, d, e)} == {"cpu"}


def test_type_reports_cuda_names_for_megatron_checks():
    assert torch.ones(1).type() == "torch.cuda.FloatTensor"
    assert torch.ones(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    # A conversion call (with an argument) is untouched.
    assert torch.ones(1).type(torch.float64).dtype == torch.float64


def _mode_on() -> bool:
    from torch.overrides import _get_current_function_mode_stack

    from moerl.compat import device_mode

    return any(m is device_mode._mode for m in _get_current_function_mode_stack())


def test_model_compute_runs_without_the_mode_and_cuda_helpers_get_it_back(monkeypatch):
    """The schedules' forward_step/backward_step (the model, the loss, backward) run
    without the per-op Python mode; the helpers in them that name CUDA get it back."""
    import threading

    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer import utils

    from moerl.compat import device_mode

    seen = {}
    assert _mode_on()
    with device_mode.suspended():
        seen["inside"] = _mode_on()
        mask = utils.get_default_causal_mask(3)  # names device="cuda": resumed for it
        seen["nested"] = _mode_on()
        with device_mode.resumed():
            seen["resumed"] = _mode_on()
            seen["cuda"] = torch.zeros(1, device="cuda").device.type
        seen["after"] = _mode_on()
    assert seen == {
        "inside": False,
        "nested": False,
        "resumed": True,
        "cuda": "cpu",
        "after": False,
    }
    assert mask.tolist() == [[False, True, True], [False, False, True], [False, False, False]]
    assert _mode_on()
    for name in ("forward_step", "backward_step"):  # wrapped by moerl.compat.megatron_patches
        assert getattr(schedules, name).__wrapped__.__module__ == schedules.__name__
    # a thread that never had the mode: both are no-ops there
    box = []
    worker = threading.Thread(target=lambda: box.append(_suspend_resume_on_this_thread()))
    worker.start()
    worker.join()
    assert box == [(False, False)]
    # the escape hatch keeps the mode on
    monkeypatch.setenv("MOERL_CPU_MODE_EVERYWHERE", "1")
    with device_mode.suspended():
        assert _mode_on()


def test_the_fp32_optimizers_gradient_loops_run_without_the_mode(monkeypatch):
    """FP32Optimizer.prepare_grads (grad ← main_grad), get_main_grads_for_grad_norm and
    the optimizers' zero_grad loop name no CUDA device: they run without the per-op
    Python mode, and do their work."""
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer import optimizer as megatron_optimizer

    seen: list[bool] = []

    class Watched(torch.nn.Parameter):
        @property
        def main_grad(self) -> torch.Tensor:  # read by prepare_grads
            seen.append(_mode_on())
            return self._main_grad

    param = Watched(torch.zeros(3))
    param._main_grad = torch.ones(3)
    param.tensor_model_parallel = True  # a TP shard: counted without the TP group's rank
    shared = megatron_optimizer.param_is_not_shared
    monkeypatch.setattr(
        megatron_optimizer,
        "param_is_not_shared",
        lambda p: seen.append(_mode_on()) or shared(p),  # read by the norm's list
    )
    opt = megatron_optimizer.FP32Optimizer(
        torch.optim.SGD([param], lr=0.1), OptimizerConfig(lr=0.1), init_state_fn=None
    )
    assert _mode_on()
    assert opt.prepare_grads() is False
    assert torch.equal(param.grad, torch.ones(3))
    grads = opt.get_main_grads_for_grad_norm()
    assert len(grads) == 1 and torch.equal(grads[0], torch.ones(3))
    assert len(seen) >= 2 and not any(seen)  # main_grad read, then param_is_not_shared
    # zero_grad's loop is wrapped the same way, where distrib_optimizer imported it too
    from megatron.core.optimizer import distrib_optimizer

    clear = megatron_optimizer._zero_grad_group_helper
    assert clear.__wrapped__.__module__ == megatron_optimizer.__name__
    assert distrib_optimizer._zero_grad_group_helper is clear
    opt.zero_grad()
    assert param.grad is None
    assert _mode_on()


def _suspend_resume_on_this_thread() -> tuple[bool, bool]:
    from moerl.compat import device_mode

    with device_mode.suspended():
        inside = _mode_on()
    return inside, _mode_on()


def test_megatron_rng_tracker_forks_and_restores_the_cpu_generator():
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    tracker.reset()
    tracker.add("moerl-test", 7)

    torch.manual_seed(0)
    outer_expected = torch.rand(4)
    forked_expected = torch.Generator().manual_seed(7)
    forked_expected = torch.rand(4, generator=forked_expected)

    torch.manual_seed(0)
    with tracker.fork("moerl-test"):
        forked = torch.rand(4)
    outer = torch.rand(4)
    assert torch.equal(forked, forked_expected)  # the fork draws from its own seeded stream
    assert torch.equal(outer, outer_expected)  # and the outer stream is restored untouched
    tracker.reset()


def test_deactivate_restores_torch_cuda():
    compat.deactivate()
    try:
        assert not compat.is_active()
        with pytest.raises((AssertionError, RuntimeError)):
            torch.cuda.current_device()
        assert torch.zeros(1).type() == "torch.FloatTensor"
    finally:
        compat.activate()


def test_missing_te_name_is_bound():
    from megatron.core.transformer.moe import moe_utils

    assert moe_utils.te_general_gemm is None


def test_alltoall_dispatcher_gets_numpy_splits():
    import numpy as np
    from megatron.core.transformer.moe import token_dispatcher

    splits = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3, 1]), as_numpy=True)
    assert isinstance(splits, np.ndarray) and splits.tolist() == [3, 1]
    kept = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3, 1]))
    assert torch.is_tensor(kept)


class _Cfg:
    def __init__(self, normalization: str, sequence_parallel: bool, zero_centered: bool = False):
        self.normalization = normalization
        self.sequence_parallel = sequence_parallel
        self.layernorm_zero_centered_gamma = zero_centered
        self.params_dtype = torch.float32


@pytest.mark.parametrize("kind", ["RMSNorm", "LayerNorm"])
@pytest.mark.parametrize("sp", [True, False])
def test_sequence_parallel_norm_marks_weights_and_matches_torch(kind, sp):
    from moerl.compat.norm import SequenceParallelTorchNorm

    norm = SequenceParallelTorchNorm(_Cfg(kind, sp), hidden_size=8, eps=1e-6)
    ref = (torch.nn.RMSNorm if kind == "RMSNorm" else torch.nn.LayerNorm)(8, eps=1e-6)
    with torch.no_grad():
        for p, q in zip(norm.parameters(), ref.parameters()):
            p.uniform_()
            q.copy_(p)
    x = torch.randn(5, 8)
    torch.testing.assert_close(norm(x), ref(x), rtol=0, atol=0)
    assert all(getattr(p, "sequence_parallel", None) is sp for p in norm.parameters())


def test_sequence_parallel_norm_rejects_zero_centered_gamma():
    from moerl.compat.norm import SequenceParallelTorchNorm

    with pytest.raises(ValueError, match="zero_centered_gamma"):
        SequenceParallelTorchNorm(_Cfg("RMSNorm", True, zero_centered=True), hidden_size=4)


def test_local_spec_uses_sp_norm_everywhere():
    from megatron.core.transformer import TransformerConfig

    from moerl.compat.norm import SequenceParallelTorchNorm
    from moerl.models.spec import _is_megatron_norm, decoder_block_spec

    cfg = TransformerConfig(
        num_layers=2,
        hidden_size=16,
        num_attention_heads=2,
        num_moe_experts=2,
        moe_layer_freq=[0, 1],
        normalization="RMSNorm",
        use_cpu_initialization=True,
    )
    spec = decoder_block_spec(cfg, use_te=False, pp_rank=0)
    found: list[object] = []

    def walk(node: object) -> None:
        import dataclasses

        if _is_megatron_norm(node):
            raise AssertionError(f"megatron-core norm {node} left in the spec")
        if node is SequenceParallelTorchNorm:
            found.append(node)
        if dataclasses.is_dataclass(node) and not isinstance(node, type):
            for f in dataclasses.fields(node):
                walk(getattr(node, f.name))
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(spec)
    # input + pre-MLP norm per layer (2 layers) and the final norm
    assert len(found) >= 5


def test_dispatcher_skips_identity_chunk_sorts_and_sorts_the_rest():
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    x, probs = torch.arange(12.0).reshape(6, 2), torch.arange(6.0)
    sizes = torch.tensor([1, 3, 2])
    same, same_probs = token_dispatcher.sort_chunks_by_idxs(x, sizes, torch.arange(3), probs)
    assert same is x and same_probs is probs  # in order already: no split, no cat
    order = torch.tensor([2, 0, 1])
    got, got_probs = token_dispatcher.sort_chunks_by_idxs(x, sizes, order, probs)
    want, want_probs = moe_utils.sort_chunks_by_idxs(x, sizes, order, probs)
    assert torch.equal(got, want) and torch.equal(got_probs, want_probs)
    assert got[:2].tolist() == [[8.0, 9.0], [10.0, 11.0]]  # the third chunk first


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD])
def test_torch_optimizers_step_without_the_mode(cls):
    """torch's optimizers (megatron-core's inner ones) step CPU parameters without the
    per-op mode; the mode is back afterwards, and the step still moves the parameter."""
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.full((3,), 0.5)
    optimizer = cls([param], lr=0.1)
    seen = []

    def closure():  # called by step() inside its body
        seen.append(_mode_on())
        return torch.zeros(())

    assert _mode_on()
    optimizer.step(closure)
    assert seen == [False] and _mode_on()
    assert torch.all(param.detach() < 1)
