"""Shared problems and references of the logprob kernel tests
(tests/unit/test_kernels_logprob.py, tests/dist/test_kernels_logprob_tp.py): logits
with sampling masks and temperatures, a dense log_softmax reference, and a runner that
returns outputs and input gradients."""

# T tokens, V vocabulary, H hidden

from __future__ import annotations

import torch

from moerl.trainer.logprobs import token_logprobs

CHUNKS = dict(chunk_tokens=16, chunk_vocab=64)  # several backward chunks and forward splits

FP32 = dict(rtol=1e-5, atol=1e-5)


def problem(tokens, vocab, hidden, *, masked=True, float_temp=False, dtype=torch.float32):  # type: ignore[no-untyped-def]
    """Logits of std ~2 at temperatures in [0.5, 1.5); every other token masked to a kept
    set of 1..5 ids that holds its label (a one-id set is greedy: logprob 0)."""
    gen = torch.Generator().manual_seed(tokens * 1000 + vocab)
    hidden_TH = torch.randn(tokens, hidden, generator=gen).to(dtype)
    weight_VH = (torch.randn(vocab, hidden, generator=gen) * 2 / hidden**0.5).to(dtype)
    labels_T = torch.randint(0, vocab, (tokens,), generator=gen)
    temp = 0.7 if float_temp else 0.5 + torch.rand(tokens, generator=gen)
    pos, ids = [], []
    for t in range(0, tokens, 2) if masked else []:
        label, extra = int(labels_T[t]), (t // 2) % 5
        # a few random ids (not the whole permutation as a list: 4K tokens × 32K ids
        # of Python ints took minutes at the GPU test's size)
        drawn = torch.randperm(vocab, generator=gen)[: extra + 1].tolist()
        kept = [label] + [i for i in drawn if i != label][:extra]
        pos += [t] * len(kept)
        ids += kept
    mask = {}
    if masked:
        mask = dict(mask_pos_N=torch.tensor(pos), mask_ids_N=torch.tensor(ids))
    g_T, g_ent_T = torch.randn(tokens, generator=gen), torch.randn(tokens, generator=gen)
    return dict(hidden=hidden_TH, weight=weight_VH, labels=labels_T, temp=temp, mask=mask,
                g=g_T, g_ent=g_ent_T)  # fmt: skip


def run(fn, p, inputs, with_entropy, **kwargs):  # type: ignore[no-untyped-def]
    """Outputs and input gradients of Σ g·logprob (+ Σ g_H·entropy)."""
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    lp_T, ent_T = fn(*leaves, p["labels"], p["temp"], **p["mask"], with_entropy=with_entropy,
                     **kwargs)  # fmt: skip
    assert (ent_T is not None) == with_entropy
    loss = (lp_T * p["g"]).sum() + ((ent_T * p["g_ent"]).sum() if with_entropy else 0)
    loss.backward()
    return [lp_T.detach()] + ([ent_T.detach()] if with_entropy else []) + [x.grad for x in leaves]


def trainer(logits_TVl, *args, with_entropy, **kwargs):  # type: ignore[no-untyped-def]
    """The trainer's current code, shaped like the kernels' API."""
    return token_logprobs(logits_TVl, *args, **kwargs), None


def dense_reference(logits_TV, labels_T, temp_T, kept: dict[int, list[int]]):  # type: ignore[no-untyped-def]
    lp, ent = [], []
    for t in range(logits_TV.shape[0]):
        row = logits_TV[t] / temp_T[t]
        if t in kept:
            row = row + torch.full_like(row, float("-inf")).index_fill(0, torch.tensor(kept[t]), 0)
        log_p = torch.log_softmax(row, dim=-1)
        lp.append(log_p[labels_T[t]])
        ent.append(-(log_p.exp() * log_p.nan_to_num(neginf=0.0)).sum())
    return torch.stack(lp), torch.stack(ent)


def kept_sets(p) -> dict[int, list[int]]:  # type: ignore[no-untyped-def]
    kept: dict[int, list[int]] = {}
    for t, i in zip(p["mask"]["mask_pos_N"].tolist(), p["mask"]["mask_ids_N"].tolist()):
        kept.setdefault(t, []).append(i)
    return kept


def reference(p, logits_TV, kept, with_entropy):  # type: ignore[no-untyped-def]
    """What ``_run`` returns, from the dense reference: [logprob, (entropy,) d logits]."""
    ref_logits = logits_TV.detach().clone().requires_grad_(True)
    ref_lp, ref_ent = dense_reference(ref_logits, p["labels"], p["temp"], kept)
    loss = (ref_lp * p["g"]).sum() + ((ref_ent * p["g_ent"]).sum() if with_entropy else 0)
    loss.backward()
    return [ref_lp.detach()] + ([ref_ent.detach()] if with_entropy else []) + [ref_logits.grad]
