"""Trainer logprobs with temperature and sampling-mask replay vs a dense torch reference."""

from __future__ import annotations

import torch

from moerl.trainer.logprobs import csr_to_pairs, token_logprobs


def _reference(logits, labels, temps, kept: dict[int, list[int]]):  # type: ignore[no-untyped-def]
    out = []
    for t in range(logits.shape[0]):
        row = logits[t] / temps[t]
        if t in kept:
            m = torch.full_like(row, float("-inf"))
            m[kept[t]] = 0.0
            row = row + m
        out.append(torch.log_softmax(row, dim=-1)[labels[t]])
    return torch.stack(out)


def test_full_vocab_and_masked_match_dense_reference():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 11, generator=gen, requires_grad=True)
    labels = torch.tensor([1, 4, 4, 0, 10, 3])
    temps = torch.tensor([1.0, 0.7, 0.7, 1.3, 1.0, 0.5])
    kept = {1: [4, 2, 7], 2: [4], 4: [10, 0, 5, 6]}  # positions 0, 3, 5 use the full vocabulary
    pos = torch.tensor([p for p, ids in kept.items() for _ in ids])
    ids = torch.tensor([i for ids in kept.values() for i in ids])
    got = token_logprobs(logits, labels, temps, mask_pos_N=pos, mask_ids_N=ids)
    ref_logits = logits.detach().clone().requires_grad_(True)
    want = _reference(ref_logits, labels, temps, kept)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert abs(got[2].item()) < 1e-6  # a one-token kept set (greedy): logprob 0
    got.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad, rtol=1e-5, atol=1e-6)


def test_csr_to_pairs():
    ids = torch.tensor([3, 1, 2, 7, 7, 0], dtype=torch.int32)
    offsets = torch.tensor([0, 2, 3, 3, 6], dtype=torch.int32)
    pos, out = csr_to_pairs(ids, offsets, first_pos=5)
    assert pos.tolist() == [5, 5, 6, 8, 8, 8]
    assert out.tolist() == [3, 1, 2, 7, 7, 0]


def test_trainer_logprobs_dispatch_to_the_kernel(monkeypatch):
    """Where moerl.kernels picks Triton (here its CPU interpreter, forced), the trainer's
    logprobs and their gradient come from the fused kernel and equal the torch path and the
    dense reference; under ``torch``, and ``auto`` on CPU tensors, the kernel never runs.

    The kernel's entry points are wrapped to count their calls and run as they are."""
    from moerl.kernels import logprob_triton
    from moerl.kernels.dispatch import backend

    calls: list[str] = []
    for entry in ("dense_stats", "dlogits"):
        real = getattr(logprob_triton, entry)

        def counted(*args, _real=real, _entry=entry, **kwargs):  # type: ignore[no-untyped-def]
            calls.append(_entry)
            return _real(*args, **kwargs)

        monkeypatch.setattr(logprob_triton, entry, counted)

    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(9, 37, generator=gen)
    labels = torch.randint(0, 37, (9,), generator=gen)
    temps = torch.full((9,), 0.8)
    pos, ids = torch.tensor([2, 2, 5]), torch.tensor([labels[2].item(), 3, labels[5].item()])
    out, grads, kernel_calls = {}, {}, {}
    for name in ("torch", "triton", "auto"):
        calls.clear()
        x = logits.clone().requires_grad_(True)
        with backend(name):
            lp = token_logprobs(x, labels, temps, mask_pos_N=pos, mask_ids_N=ids)
            (lp * torch.arange(9.0)).sum().backward()
        out[name], grads[name], kernel_calls[name] = lp.detach(), x.grad, list(calls)
    assert kernel_calls == {"torch": [], "triton": ["dense_stats", "dlogits"], "auto": []}
    ref_logits = logits.clone().requires_grad_(True)
    want = _reference(ref_logits, labels, temps, {2: [labels[2].item(), 3], 5: [labels[5].item()]})
    (want * torch.arange(9.0)).sum().backward()
    for name in ("torch", "triton", "auto"):
        torch.testing.assert_close(out[name], want.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grads[name], ref_logits.grad, rtol=1e-5, atol=1e-5)
