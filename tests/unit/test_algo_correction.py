"""IS corrections against hand-computed references.

The shared batch: six tokens in two sequences; token 2 is a prompt token (not counted)
with an absurd log ratio of 50 that must not reach any weight, sum or metric.

    seq                 0     0     0*    1     1     1
    ratio trainer/roll  3     0.6   e^50  1.5   1.2   0.25

Sequence level: seq 0 → 3·0.6 = 1.8, seq 1 → 1.5·1.2·0.25 = 0.45.
Geometric level: seq 0 → sqrt(1.8) = 1.341641, seq 1 → 0.45^(1/3) = 0.766309.
"""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch

from moerl.algo.correction import (
    CORRECTIONS,
    CorrectionInput,
    build_correction,
    combine,
    icepop,
    mis,
    none,
    opsm,
    tis,
    topr,
    version_gap,
)
from moerl.algo.correction_config import (
    CorrectionConfig,
    IcePopConfig,
    MISConfig,
    OPSMConfig,
    TISConfig,
    TOPRConfig,
    VersionGapConfig,
)

F64 = torch.float64
RATIOS = [3.0, 0.6, math.exp(50.0), 1.5, 1.2, 0.25]
MASK = [True, True, False, True, True, True]
SEQ = [0, 0, 0, 1, 1, 1]
SQ18, CB45 = math.sqrt(1.8), 0.45 ** (1 / 3)


def _inp(ratios=RATIOS, mask=MASK, seq=SEQ, **kw) -> CorrectionInput:
    rollout = torch.full((len(ratios),), -1.0, dtype=F64)
    log_r = torch.tensor([math.log(r) for r in ratios], dtype=F64)
    return CorrectionInput(
        trainer_logprobs_T=rollout + log_r,
        rollout_logprobs_T=rollout,
        loss_mask_T=torch.tensor(mask, dtype=torch.bool),
        seq_ids_T=torch.tensor(seq, dtype=torch.int64),
        num_seqs=max(seq) + 1,
        **kw,
    )


def _check(out, weights: list[float], keep: list[bool]) -> None:
    torch.testing.assert_close(out.weights_T, torch.tensor(weights, dtype=F64), atol=1e-6, rtol=0)
    assert out.keep_T.tolist() == keep
    assert not out.weights_T.requires_grad


KEEP_COUNTED = [True, True, False, True, True, True]


def test_none() -> None:
    out = none(_inp(), CorrectionConfig())
    _check(out, [1, 1, 0, 1, 1, 1], KEEP_COUNTED)
    # k3 per counted token, r - 1 - ln r: 3 → 0.901388, 0.6 → 0.110826, 1.5 → 0.094535,
    # 1.2 → 0.017678, 0.25 → 0.636294; mean 1.760721/5.
    assert out.metrics["is/mismatch_kl"] == pytest.approx(0.352144, abs=1e-6)


@pytest.mark.parametrize(
    "cfg, weights, clipped",
    [
        # token: min(r, 2) → [2, 0.6, -, 1.5, 1.2, 0.25]; one of five clipped.
        (TISConfig(cap=2.0), [2, 0.6, 0, 1.5, 1.2, 0.25], 1 / 5),
        # sequence: 1.8 and 0.45, both under 2.
        (TISConfig(cap=2.0, level="sequence"), [1.8, 1.8, 0, 0.45, 0.45, 0.45], 0.0),
        # sequence, cap 1.5: seq 0's two tokens clipped.
        (TISConfig(cap=1.5, level="sequence"), [1.5, 1.5, 0, 0.45, 0.45, 0.45], 2 / 5),
        # geometric: sqrt(1.8) and 0.45^(1/3).
        (TISConfig(cap=2.0, level="geometric"), [SQ18, SQ18, 0, CB45, CB45, CB45], 0.0),
        # lower clip, token, [0.5, 2]: 3 → 2 above, 0.25 → 0.5 below: two of five clipped.
        (TISConfig(low=0.5, cap=2.0), [2, 0.6, 0, 1.5, 1.2, 0.5], 2 / 5),
        # lower clip, sequence, [0.5, 2]: seq 1's 0.45 is raised to 0.5 on its three tokens.
        (TISConfig(low=0.5, level="sequence"), [1.8, 1.8, 0, 0.5, 0.5, 0.5], 3 / 5),
    ],
)
def test_tis(cfg: TISConfig, weights: list[float], clipped: float) -> None:
    out = tis(_inp(), cfg)
    _check(out, weights, KEEP_COUNTED)
    assert out.metrics["is/clipped_frac"] == pytest.approx(clipped)


@pytest.mark.parametrize(
    "cfg, message",
    [
        (TISConfig(low=-0.1), "correction.low=-0.1 must be >= 0.0"),
        (TISConfig(low=2.0, cap=2.0), "correction.low=2.0 must be < correction.cap=2.0"),
    ],
)
def test_tis_bad_low(cfg: TISConfig, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        build_correction(cfg)


def test_tis_metrics() -> None:
    out = tis(_inp(), TISConfig(cap=2.0))
    # (2 + 0.6 + 1.5 + 1.2 + 0.25)/5 = 1.11; max 2; nothing masked.
    assert out.metrics["is/weight_mean"] == pytest.approx(1.11)
    assert out.metrics["is/weight_max"] == pytest.approx(2.0)
    assert out.metrics["is/masked_frac"] == 0.0


@pytest.mark.parametrize(
    "fn, cfg, weights, keep",
    [
        # token [0.5, 2]: 3 and 0.25 dropped; kept ones weighted by their ratio.
        (mis, MISConfig(), [0, 0.6, 0, 1.5, 1.2, 0], [False, True, False, True, True, False]),
        # IcePop's band [0.5, 5]: only 0.25 dropped.
        (icepop, IcePopConfig(), [3, 0.6, 0, 1.5, 1.2, 0], [True, True, False, True, True, False]),
        # sequence [0.5, 2]: 1.8 kept, 0.45 dropped — the whole of seq 1.
        (
            mis,
            MISConfig(level="sequence"),
            [1.8, 1.8, 0, 0, 0, 0],
            [True, True, False, False, False, False],
        ),
        # geometric [0.8, 2] without reweighting (Geo-Mask): 1.3416 kept, 0.7663 dropped.
        (
            mis,
            MISConfig(low=0.8, level="geometric", reweight=False),
            [1, 1, 0, 0, 0, 0],
            [True, True, False, False, False, False],
        ),
    ],
)
def test_masked_is(fn, cfg: MISConfig, weights: list[float], keep: list[bool]) -> None:
    out = fn(_inp(), cfg)
    _check(out, weights, keep)
    dropped = sum(1 for k, m in zip(keep, MASK) if m and not k)
    assert out.metrics["is/masked_frac"] == pytest.approx(dropped / 5)


def test_bounds_are_inclusive() -> None:
    # trainer == rollout gives ratio 1 exactly: kept by [1, 2] and by [0.5, 1], not
    # clipped by cap 1 nor by low 1.
    inp = _inp(ratios=[1.0, 1.0], mask=[True, True], seq=[0, 1])
    _check(mis(inp, MISConfig(low=1.0, high=2.0)), [1, 1], [True, True])
    _check(mis(inp, MISConfig(low=0.5, high=1.0)), [1, 1], [True, True])
    for cfg in (TISConfig(cap=1.0), TISConfig(low=1.0, cap=2.0)):
        out = tis(inp, cfg)
        _check(out, [1, 1], [True, True])
        assert out.metrics["is/clipped_frac"] == 0.0


def test_sequence_level_overflow_is_safe() -> None:
    # A product of large ratios overflows to inf: TIS caps it, MIS drops it, never nan.
    inp = _inp(ratios=[math.exp(400.0), math.exp(400.0)], mask=[True, True], seq=[0, 0])
    _check(tis(inp, TISConfig(level="sequence")), [2, 2], [True, True])
    _check(mis(inp, MISConfig(level="sequence")), [0, 0], [False, False])


# Batch normalisation: the weights after truncation / masking divided by their mean.
#   tis token, cap 2: [2, 0.6, 1.5, 1.2, 0.25] sum 5.55 over 5 counted → ÷ 1.11
#   tis sequence, cap 2: sequences 1.8 and 0.45 → ÷ 1.125 (a token mean, 0.99, would be
#       wrong: seq 1 has more tokens)
#   tis geometric: sqrt(1.8) and 0.45^(1/3) → ÷ their mean
#   mis token [0.5, 2]: kept [0.6, 1.5, 1.2], dropped 3 and 0.25 count as 0: ÷ 3.3/5 = 0.66
#   mis sequence [0.5, 2]: seq 0 kept at 1.8, seq 1 dropped (0) → ÷ 0.9
GEO = (SQ18 + CB45) / 2


@pytest.mark.parametrize(
    "fn, cfg, factor, weights",
    [
        (tis, TISConfig(), 1.11, [2, 0.6, 0, 1.5, 1.2, 0.25]),
        (tis, TISConfig(level="sequence"), 1.125, [1.8, 1.8, 0, 0.45, 0.45, 0.45]),
        (tis, TISConfig(level="geometric"), GEO, [SQ18, SQ18, 0, CB45, CB45, CB45]),
        (mis, MISConfig(), 0.66, [0, 0.6, 0, 1.5, 1.2, 0]),
        (mis, MISConfig(level="sequence"), 0.9, [1.8, 1.8, 0, 0, 0, 0]),
        (icepop, IcePopConfig(), (3 + 0.6 + 1.5 + 1.2) / 5, [3, 0.6, 0, 1.5, 1.2, 0]),
    ],
)
def test_batch_normalize(fn, cfg, factor: float, weights: list[float]) -> None:
    cfg = dataclasses.replace(cfg, batch_normalize=True)
    out = fn(_inp(), cfg)
    expected = [w / factor for w in weights]
    _check(out, expected, [w > 0 for w in weights])
    assert out.metrics["is/batch_norm_factor"] == pytest.approx(factor)
    w = out.weights_T.tolist()
    if cfg.level == "token":
        assert sum(w[i] for i in (0, 1, 3, 4, 5)) / 5 == pytest.approx(1.0, abs=1e-12)
    else:
        assert (w[0] + w[3]) / 2 == pytest.approx(1.0, abs=1e-12)


def test_batch_normalize_skips_sequences_with_nothing_counted() -> None:
    # Sequences 4 (cap) and 0.5, and a third with no counted token: mean over two, 2.25.
    inp = _inp(ratios=[2.0, 2.0, 0.5, 9.0], mask=[True, True, True, False], seq=[0, 0, 1, 2])
    out = tis(inp, TISConfig(cap=4.0, level="sequence", batch_normalize=True))
    _check(out, [4 / 2.25, 4 / 2.25, 0.5 / 2.25, 0], [True, True, True, False])


def test_batch_normalize_with_everything_dropped_leaves_zeros() -> None:
    out = mis(_inp(), MISConfig(low=10.0, high=20.0, batch_normalize=True))
    _check(out, [0] * 6, [False] * 6)
    assert out.metrics["is/batch_norm_factor"] == 1.0


def test_batch_normalize_needs_reweight() -> None:
    with pytest.raises(ValueError, match="correction.batch_normalize=true needs"):
        build_correction(MISConfig(reweight=False, batch_normalize=True))


def test_topr() -> None:
    # Advantages: seq 0 positive, seq 1 negative. Sequence level: seq 0 weight 1 (no IS
    # although its ratio is 1.8); seq 1 min(0.45, 1) = 0.45.
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -1.0], dtype=F64)
    out = topr(_inp(advantages_T=adv), TOPRConfig())
    _check(out, [1, 1, 0, 0.45, 0.45, 0.45], KEEP_COUNTED)
    assert out.metrics["is/negative_frac"] == pytest.approx(3 / 5)
    # Token level: seq 1's ratios 1.5, 1.2 truncated to 1, 0.25 kept → two of five clipped.
    out = topr(_inp(advantages_T=adv), TOPRConfig(level="token"))
    _check(out, [1, 1, 0, 1, 1, 0.25], KEEP_COUNTED)
    assert out.metrics["is/clipped_frac"] == pytest.approx(2 / 5)


def test_topr_needs_advantages() -> None:
    with pytest.raises(ValueError, match="advantages_T"):
        topr(_inp(), TOPRConfig())


# OPSM: trainer logprobs 0, so log(μ/π) = rollout logprob. Token 2 is a prompt token.
#   seq 0  A=-1  log μ/π [0.3, 0.1] (+ 50 uncounted)  mean 0.2 > 0.1 → dropped
#   seq 1  A=+1  [0.5, 0.5]                            mean 0.5, but A > 0 → kept
#   seq 2  A=-1  [0.3, -0.2]                           mean 0.05 → kept
#   seq 3  A=-1  [0.1]                                 mean 0.1 = δ, not above → kept
# With the sign reversed (log π/μ) seq 0 would be kept: the direction is tested.
OPSM_MU = [0.3, 0.1, 50.0, 0.5, 0.5, 0.3, -0.2, 0.1]
OPSM_ADV = [-1.0, -1.0, -1.0, 1.0, 1.0, -1.0, -1.0, -1.0]
OPSM_MASK = [True, True, False, True, True, True, True, True]
OPSM_SEQ = [0, 0, 0, 1, 1, 2, 2, 3]


def _opsm_inp(advantages=OPSM_ADV) -> CorrectionInput:
    return CorrectionInput(
        trainer_logprobs_T=torch.zeros(8, dtype=F64),
        rollout_logprobs_T=torch.tensor(OPSM_MU, dtype=F64),
        loss_mask_T=torch.tensor(OPSM_MASK),
        seq_ids_T=torch.tensor(OPSM_SEQ),
        num_seqs=4,
        advantages_T=None if advantages is None else torch.tensor(advantages, dtype=F64),
    )


@pytest.mark.parametrize(
    "delta, keep",
    [
        (0.1, [False, False, False, True, True, True, True, True]),
        # δ 0: seq 2 (0.05) and seq 3 (0.1) drift above it too.
        (0.0, [False, False, False, True, True, False, False, False]),
        # δ 0.3: nothing negative drifts that far.
        (0.3, [True, True, False, True, True, True, True, True]),
    ],
)
def test_opsm(delta: float, keep: list[bool]) -> None:
    out = opsm(_opsm_inp(), OPSMConfig(delta=delta))
    _check(out, [float(k) for k in keep], keep)
    dropped = sum(1 for k, m in zip(keep, OPSM_MASK) if m and not k)
    assert out.metrics["is/masked_frac"] == pytest.approx(dropped / 7)
    assert out.metrics["is/negative_frac"] == pytest.approx(5 / 7)
    # Sequence means 0.2, 0.5, 0.05, 0.1 over the four sequences.
    assert out.metrics["is/seq_kl_mean"] == pytest.approx(0.85 / 4)


def test_opsm_needs_advantages() -> None:
    with pytest.raises(ValueError, match="correction=opsm needs CorrectionInput.advantages_T"):
        opsm(_opsm_inp(advantages=None), OPSMConfig())


def test_opsm_bad_delta() -> None:
    with pytest.raises(ValueError, match=re.escape("correction.delta=-0.1 must be >= 0.0")):
        build_correction(OPSMConfig(delta=-0.1))


VERSIONS = torch.tensor([5, 4, 0, 3, 5, 5])  # gaps at version 5: [0, 1, 5*, 2, 0, 0]


@pytest.mark.parametrize(
    "cfg, keep",
    [
        # max_gap 1: token 3 (gap 2) dropped; token 2's gap 5 does not count.
        (VersionGapConfig(max_gap=1), [True, True, False, False, True, True]),
        # sequence: seq 1 holds a stale token → dropped whole; seq 0 stays, its stale
        # token is a prompt token.
        (VersionGapConfig(max_gap=1, level="sequence"), [True, True, False, False, False, False]),
        # max_gap 0: strictly on-policy, only version-5 tokens.
        (VersionGapConfig(max_gap=0), [True, False, False, False, True, True]),
    ],
)
def test_version_gap(cfg: VersionGapConfig, keep: list[bool]) -> None:
    out = version_gap(_inp(versions_T=VERSIONS, current_version=5), cfg)
    _check(out, [float(k) for k in keep], keep)
    # Counted gaps [0, 1, 2, 0, 0]: mean 0.6, max 2.
    assert out.metrics["is/gap_mean"] == pytest.approx(0.6)
    assert out.metrics["is/gap_max"] == pytest.approx(2.0)


def test_version_gap_needs_versions() -> None:
    with pytest.raises(ValueError, match="versions_T and current_version"):
        version_gap(_inp(), VersionGapConfig())


def test_combine_version_gap_then_tis() -> None:
    inp = _inp(versions_T=VERSIONS, current_version=5)
    out = combine(version_gap(inp, VersionGapConfig()), tis(inp, TISConfig()))
    # TIS token weights [2, 0.6, -, 1.5, 1.2, 0.25] with token 3 dropped as stale.
    _check(out, [2, 0.6, 0, 0, 1.2, 0.25], [True, True, False, False, True, True])


def test_every_builtin_zeroes_uncounted_tokens() -> None:
    adv = torch.ones(6, dtype=F64)
    inp = _inp(versions_T=VERSIONS, current_version=5, advantages_T=adv)
    for name in CORRECTIONS.names():
        out = build_correction(name)(inp)
        assert out.weights_T[2] == 0.0 and not out.keep_T[2], name
        assert torch.isfinite(out.weights_T).all(), name
