"""Mismatch metrics against hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest

from moerl.telemetry.mismatch import decompose, k3, k3_per_token, staleness_histogram


def test_k3_by_hand():
    # d = log r = 0.1 → r − 1 − log r = e^0.1 − 1.1 = 0.005170918...
    assert k3_per_token(np.array([0.1]), np.array([0.0]))[0] == pytest.approx(math.exp(0.1) - 1.1)
    assert k3(np.array([-1.0, -2.0]), np.array([-1.0, -2.0])) == 0.0
    assert k3_per_token(np.array([1e-9]), np.array([0.0]))[0] >= 0  # no cancellation below 0


def test_staleness_histogram():
    assert staleness_histogram(np.array([5, 5, 4, 2]), 5) == {0: 2, 1: 1, 3: 1}


def test_decomposition_by_hand():
    zero = np.zeros(4)
    # base (replay+mask) differs only on token 3 (stale) by 0.1; fresh routing adds 0.2 on
    # token 0; full vocab adds 0.3 on token 1; with nothing on, token 2 is off by 0.5
    base = np.array([0.0, 0.0, 0.0, 0.1])
    e = lambda d: math.exp(d) - 1 - d  # noqa: E731
    dec = decompose(
        replay_mask_T=base,
        fresh_route_mask_T=base + np.array([0.2, 0, 0, 0]),
        replay_full_vocab_T=base + np.array([0, 0.3, 0, 0]),
        fresh_route_full_vocab_T=np.array([0, 0, 0.5, 0]),
        rollout_sampling_T=zero,
        rollout_full_T=zero,
        stale_T=np.array([False, False, False, True]),
    )
    assert dec.staleness == pytest.approx(e(0.1) / 4)
    assert dec.numerics == pytest.approx(0.0)
    assert dec.routing == pytest.approx(e(0.2) / 4)
    assert dec.sampling_mask == pytest.approx(e(0.3) / 4)
    assert dec.total == pytest.approx(e(0.5) / 4)
