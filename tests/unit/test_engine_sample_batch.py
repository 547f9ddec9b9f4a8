"""``sample_batch`` (one batched draw for rows sharing sampling parameters) against the
per-row ``kept_set`` and a hand-computed renormalisation, and its draws against the
kept set's probabilities."""

from __future__ import annotations

import math

import pytest
import torch

from moerl.engine.core.sampling import SamplingParams, kept_set, sample_batch


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": 1.0},
        {"temperature": 0.7, "top_k": 5},
        {"temperature": 1.3, "top_p": 0.8},
        {"temperature": 1.0, "min_p": 0.05, "top_k": 20},
        {"temperature": 0.0},
    ],
)
def test_each_row_matches_the_per_row_definitions(fields):
    params = SamplingParams.from_request(fields, 64)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 64, generator=gen) * 3
    logits[2, :10] = -math.inf  # a row with impossible tokens
    got = sample_batch(logits, params, gen, [True, False, True, True, True, True])
    temp = 1.0 if params.greedy else params.temperature
    for b, s in enumerate(got):
        logprobs = torch.log_softmax(logits[b] / temp, -1)
        keep = kept_set(logits[b], params)
        assert keep[s.token]
        assert s.logprob == pytest.approx(float(logprobs[s.token]), abs=1e-5)
        kept = torch.nonzero(keep).flatten()
        renorm = logprobs[s.token] - torch.logsumexp(logprobs[kept], 0)
        assert s.sampling_logprob == pytest.approx(float(renorm), abs=1e-5)
        if b == 1:  # no details asked
            assert s.mask == [] and s.support_logprobs == []
            continue
        want = kept[torch.argsort(logprobs[kept], descending=True, stable=True)].tolist()
        assert s.mask == want
        assert sum(math.exp(x) for x in s.support_logprobs) == pytest.approx(1.0, abs=1e-5)


def test_draws_follow_the_renormalised_kept_set():
    params = SamplingParams.from_request({"temperature": 1.0, "top_k": 3}, 8)
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -2.0, -3.0, -4.0]]).repeat(4000, 1)
    got = sample_batch(logits, params, torch.Generator().manual_seed(1), [False] * 4000)
    counts = torch.bincount(torch.tensor([s.token for s in got]), minlength=8).float()
    assert counts[3:].sum() == 0  # outside the top 3: never
    want = torch.softmax(torch.tensor([2.0, 1.0, 0.5]), 0)
    assert torch.allclose(counts[:3] / 4000, want, atol=0.03)
