"""Fused logprob + entropy: each Triton kernel against its torch twin (values and autograd
gradients), the twin and the trainer's ``token_logprobs`` against a dense log_softmax
reference written here, and the vocab-sharded TP=2 results against one process.

On CPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET)
with small tiles, so tiny shapes still cover ragged token and vocabulary blocks, a
vocabulary smaller than one block, one token, and several vocabulary / token chunks.
"""

# T tokens, V vocabulary, Vl this rank's vocabulary shard, H hidden, N kept (position, id) pairs

from __future__ import annotations

import pytest
import torch
from kernels_logprob_cases import CHUNKS, FP32
from kernels_logprob_cases import kept_sets as _kept_sets
from kernels_logprob_cases import problem as _problem
from kernels_logprob_cases import reference as _reference
from kernels_logprob_cases import run as _run
from kernels_logprob_cases import trainer as _trainer

from moerl.device import device, has_cuda
from moerl.kernels import logprob
from moerl.kernels.dispatch import backend
from moerl.kernels.logprob import fused_logprobs, logprobs_from_logits

# (T, V, H): ragged blocks, V below one block, one token, exact block multiples
SHAPES = [(37, 150, 24), (5, 20, 16), (1, 70, 40), (32, 64, 32)]
BF16_GRAD = dict(rtol=2e-2, atol=2e-2)
BF16_SCALED = 2e-2  # max error ≤ this × max |grad|: ~2.5 bf16 ulps of the largest entry


def _compare(fn, p, inputs, with_entropy, out_tol, grad_tol, **kwargs):  # type: ignore[no-untyped-def]
    with backend("torch"):
        want = _run(fn, p, inputs, with_entropy, **kwargs)
    with backend("triton"):
        got = _run(fn, p, inputs, with_entropy, **kwargs)
    outs = 2 if with_entropy else 1
    for g, w in zip(got[:outs], want[:outs]):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, w, **out_tol)
    for g, w in zip(got[outs:], want[outs:]):
        assert g.dtype == w.dtype
        if isinstance(grad_tol, float):  # relative to the largest entry: sums of many bf16 terms
            assert (g.float() - w.float()).abs().max() <= grad_tol * w.float().abs().max()
        else:
            torch.testing.assert_close(g.float(), w.float(), **grad_tol)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize(("masked", "with_entropy"), [(False, False), (True, True)])
def test_fused_kernel_matches_twin_fp32(shape, masked, with_entropy):
    p = _problem(*shape, masked=masked, float_temp=shape[0] == 5)
    _compare(fused_logprobs, p, [p["hidden"], p["weight"]], with_entropy, FP32, FP32, **CHUNKS)


@pytest.mark.parametrize(("masked", "with_entropy"), [(True, False), (False, True)])
def test_fused_kernel_matches_twin_other_combinations(masked, with_entropy):
    p = _problem(37, 150, 24, masked=masked)
    _compare(fused_logprobs, p, [p["hidden"], p["weight"]], with_entropy, FP32, FP32, **CHUNKS)


@pytest.mark.parametrize("shape", [(37, 150, 24), (1, 20, 16)], ids=["ragged", "one-token"])
def test_fused_kernel_matches_twin_bf16(shape):
    p = _problem(*shape, dtype=torch.bfloat16)
    # Both accumulate exact bf16 products in fp32, so forward stays tight; the kernel's
    # backward rounds dlogits to bf16 before its matmuls.
    _compare(fused_logprobs, p, [p["hidden"], p["weight"]], True, FP32, BF16_GRAD, **CHUNKS)


@pytest.mark.parametrize("shape", SHAPES[:3], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize(("masked", "with_entropy"), [(False, False), (True, True)])
def test_logits_kernel_matches_twin_fp32(shape, masked, with_entropy):
    p = _problem(*shape, masked=masked)
    logits_TV = p["hidden"] @ p["weight"].T
    _compare(logprobs_from_logits, p, [logits_TV], with_entropy, FP32, FP32, chunk_vocab=64)


def test_logits_kernel_matches_twin_bf16():
    p = _problem(37, 150, 24)
    logits_TV = (p["hidden"] @ p["weight"].T).bfloat16()
    _compare(logprobs_from_logits, p, [logits_TV], True, FP32, BF16_GRAD)


def test_fused_kernel_frozen_weight_and_no_grad():
    """A frozen output layer (LoRA training) gets no weight gradient; no_grad just runs."""
    p = _problem(37, 150, 24)
    grads = {}
    for name in ("torch", "triton"):
        hidden_TH = p["hidden"].clone().requires_grad_(True)
        with backend(name):
            lp_T, _ = fused_logprobs(hidden_TH, p["weight"], p["labels"], p["temp"], **p["mask"])
            (lp_T * p["g"]).sum().backward()
            with torch.no_grad():
                again_T, _ = fused_logprobs(hidden_TH, p["weight"], p["labels"], p["temp"])
        assert again_T.grad_fn is None
        grads[name] = hidden_TH.grad
    torch.testing.assert_close(grads["triton"], grads["torch"], **FP32)


def test_twin_matches_trainer_and_dense_reference():
    """The twin (logits and fused), and the trainer's ``token_logprobs``, each against the
    dense log_softmax reference; the fused gradients through the chain rule by hand."""
    p = _problem(37, 150, 24)
    logits_TV = p["hidden"] @ p["weight"].T
    kept = _kept_sets(p)
    want = _reference(p, logits_TV, kept, with_entropy=True)
    with backend("torch"):
        got = _run(logprobs_from_logits, p, [logits_TV], True)
        fused = _run(fused_logprobs, p, [p["hidden"], p["weight"]], True)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **FP32)
    d_logits_TV = want[2]
    fused_want = want[:2] + [d_logits_TV @ p["weight"], d_logits_TV.T @ p["hidden"]]
    for g, w in zip(fused, fused_want):
        torch.testing.assert_close(g, w, **FP32)
    trainer = _run(_trainer, p, [logits_TV], False)
    for g, w in zip(trainer, _reference(p, logits_TV, kept, with_entropy=False)):
        torch.testing.assert_close(g, w, **FP32)
    greedy = [t for t, ids in kept.items() if len(ids) == 1]
    assert greedy and got[0][greedy].abs().max() < 1e-6 and got[1][greedy].abs().max() < 1e-6


def test_auto_backend_runs_the_twin_on_cpu(monkeypatch):
    def no_kernels():  # type: ignore[no-untyped-def]
        raise AssertionError("auto picked the Triton kernel for CPU tensors")

    monkeypatch.setattr(logprob, "_ops", no_kernels)
    p = _problem(5, 20, 16)
    with backend("auto"):
        lp_T, ent_T = fused_logprobs(p["hidden"], p["weight"], p["labels"], with_entropy=True)
        lp2_T, _ = logprobs_from_logits(p["hidden"] @ p["weight"].T, p["labels"])
    assert ent_T is not None and torch.isfinite(ent_T).all()
    torch.testing.assert_close(lp_T, lp2_T, **FP32)


def test_bad_inputs_are_explained():
    p = _problem(5, 20, 16)
    with pytest.raises(ValueError, match="both mask_pos_N and mask_ids_N"):
        fused_logprobs(p["hidden"], p["weight"], p["labels"], mask_pos_N=torch.tensor([0]))
    with pytest.raises(ValueError, match="same H"):
        fused_logprobs(p["hidden"], p["weight"][:, :8], p["labels"])
    with pytest.raises(ValueError, match="bfloat16"):
        fused_logprobs(p["hidden"], p["weight"].bfloat16(), p["labels"])


@pytest.mark.gpu
@pytest.mark.skipif(not has_cuda(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("with_entropy", [False, True])
def test_gpu_size_kernels_match_twin(with_entropy):
    p = _problem(4096, 32768, 2048, dtype=torch.bfloat16)
    gpu = {k: v.to(device()) if torch.is_tensor(v) else v for k, v in p.items()}
    gpu["mask"] = {k: v.to(device()) for k, v in p["mask"].items()}
    out_tol = dict(rtol=1e-4, atol=1e-3)  # block-order fp32 sums of 2048 products
    inputs = [gpu["hidden"], gpu["weight"]]
    _compare(fused_logprobs, gpu, inputs, with_entropy, out_tol, BF16_SCALED)
    logits_TV = gpu["hidden"] @ gpu["weight"].T
    _compare(logprobs_from_logits, gpu, [logits_TV], with_entropy, out_tol, BF16_SCALED)
