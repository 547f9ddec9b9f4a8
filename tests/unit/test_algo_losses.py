"""Policy losses, the aggregation modes and the KL term against hand-computed references.

Logprobs are logs of chosen probabilities so every ratio is a round number. With
token_mean over N counted tokens, d loss / d logp_t = (per-token derivative) / N; for an
unclipped PPO token the per-token derivative of -r·A is -r·A (dr/dlogp = r).
"""

from __future__ import annotations

import math

import pytest
import torch

from moerl.algo.config import (
    CISPOConfig,
    GMPOConfig,
    GSPOConfig,
    KLConfig,
    PPOClipConfig,
    ReinforceConfig,
    SAPOConfig,
)
from moerl.algo.kl import KLInput, kl_penalty, kl_term
from moerl.algo.losses import (
    POLICY_LOSSES,
    PolicyLossInput,
    aggregate,
    build_policy_loss,
    cispo,
    gmpo,
    gspo,
    ppo_clip,
    reinforce,
    sapo,
)

F64 = torch.float64


def _t(values, dtype=F64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def _logs(*probs: float) -> list[float]:
    return [math.log(p) for p in probs]


def _inp(logp, old, adv, mask=None, seq=None, num_seqs=None, **kw) -> PolicyLossInput:
    n = len(logp)
    mask = [True] * n if mask is None else mask
    seq = list(range(n)) if seq is None else seq
    return PolicyLossInput(
        logprobs_T=_t(logp).requires_grad_(True),
        old_logprobs_T=_t(old),
        advantages_T=_t(adv),
        loss_mask_T=torch.tensor(mask, dtype=torch.bool),
        seq_ids_T=torch.tensor(seq, dtype=torch.int64),
        num_seqs=max(seq) + 1 if num_seqs is None else num_seqs,
        **kw,
    )


def _grad(out, inp: PolicyLossInput) -> list[float]:
    (g,) = torch.autograd.grad(out.loss, inp.logprobs_T)
    return g.tolist()


# --- aggregation ---------------------------------------------------------------


def test_aggregate_modes() -> None:
    # Values [1, 2, 3, 4, inf]; the last token does not count; sequence 2 has no counted
    # token. token_mean: 10/4. seq_mean_token_mean: (1.5 + 3.5 + 0)/3. seq_mean_token_sum:
    # (3 + 7 + 0)/3. The inf in the masked token must not leak.
    values = _t([1.0, 2.0, 3.0, 4.0, math.inf])
    mask = torch.tensor([True, True, True, True, False])
    seq = torch.tensor([0, 0, 1, 1, 2])
    assert aggregate(values, mask, seq, 3, "token_mean").item() == pytest.approx(2.5)
    assert aggregate(values, mask, seq, 3, "seq_mean_token_mean").item() == pytest.approx(5 / 3)
    assert aggregate(values, mask, seq, 3, "seq_mean_token_sum").item() == pytest.approx(10 / 3)
    # seq_mean_token_sum_norm with L_max 4: 10 / (3 · 4), whatever the sequences' lengths.
    norm = aggregate(values, mask, seq, 3, "seq_mean_token_sum_norm", norm_length=4)
    assert norm.item() == pytest.approx(10 / 12)
    with pytest.raises(ValueError, match="token_sum"):
        aggregate(values, mask, seq, 3, "token_sum")


@pytest.mark.parametrize("norm_length", [None, 0])
def test_aggregate_norm_needs_a_length(norm_length) -> None:
    values, mask, seq = _t([1.0]), torch.tensor([True]), torch.tensor([0])
    with pytest.raises(ValueError, match="needs norm_length > 0"):
        aggregate(values, mask, seq, 1, "seq_mean_token_sum_norm", norm_length=norm_length)


def test_aggregate_norm_is_linear_over_micro_batches() -> None:
    # The trainer sums aggregate(micro-batch) · its sequences and divides by the step's.
    # Micro-batch 1: seqs {[1, 2], [3]}; micro-batch 2: seq {[4, 5, 6]}; L_max 3.
    # Whole step: 21 / (3 · 3) = 7/3. Parts: 6/(2·3)·2 + 15/(1·3)·1 = 6/3 + 15/3 = 21/3, ÷ 3.
    mode = "seq_mean_token_sum_norm"
    whole = aggregate(
        _t([1.0, 2, 3, 4, 5, 6]), torch.ones(6, dtype=torch.bool),
        torch.tensor([0, 0, 1, 2, 2, 2]), 3, mode, norm_length=3,
    )  # fmt: skip
    first = aggregate(
        _t([1.0, 2, 3]), torch.ones(3, dtype=torch.bool), torch.tensor([0, 0, 1]), 2, mode,
        norm_length=3,
    )  # fmt: skip
    second = aggregate(
        _t([4.0, 5, 6]), torch.ones(3, dtype=torch.bool), torch.tensor([0, 0, 0]), 1, mode,
        norm_length=3,
    )  # fmt: skip
    assert whole.item() == pytest.approx(7 / 3)
    assert ((first * 2 + second * 1) / 3).item() == pytest.approx(7 / 3)


def test_aggregate_nothing_counted_is_zero() -> None:
    values, mask, seq = _t([5.0]), torch.tensor([False]), torch.tensor([0])
    for mode in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum"):
        assert aggregate(values, mask, seq, 1, mode).item() == 0.0
    assert aggregate(values, mask, seq, 1, "seq_mean_token_sum_norm", norm_length=8).item() == 0.0


# --- ppo_clip ------------------------------------------------------------------

# Ratios [1.5, 0.5, 0.5, 1.5, e^10] with advantages [+1, +1, -1, -1, +5], eps 0.2:
#   t0  A>0, r=1.5 > 1.2   clipped high: loss -1.2, grad 0
#   t1  A>0, r=0.5         unclipped (min picks r·A): loss -0.5, per-token grad -0.5
#   t2  A<0, r=0.5 < 0.8   clipped low: loss +0.8, grad 0
#   t3  A<0, r=1.5         unclipped: loss +1.5, per-token grad +1.5
#   t4  masked (a prompt token): must not count
PPO_CASE = dict(
    logp=[math.log(1.5), math.log(0.5), math.log(0.5), math.log(1.5), 10.0],
    old=[0.0] * 5,
    adv=[1.0, 1.0, -1.0, -1.0, 5.0],
    mask=[True, True, True, True, False],
    seq=[0, 1, 1, 1, 1],
)


def test_ppo_clip_token_mean() -> None:
    inp = _inp(**PPO_CASE)
    out = ppo_clip(inp, PPOClipConfig())
    # (-1.2 - 0.5 + 0.8 + 1.5) / 4 = 0.15; grads /4: [0, -0.125, 0, 0.375, 0].
    assert out.loss.item() == pytest.approx(0.15)
    assert _grad(out, inp) == pytest.approx([0.0, -0.125, 0.0, 0.375, 0.0])
    assert out.metrics["loss/clip_frac"] == pytest.approx(0.5)
    assert out.metrics["loss/clip_high_frac"] == pytest.approx(0.25)
    assert out.metrics["loss/clip_low_frac"] == pytest.approx(0.25)


@pytest.mark.parametrize(
    "agg, loss, grads",
    [
        # seq 0 = {t0}: -1.2; seq 1 = {t1, t2, t3}: sum 1.8, mean 0.6.
        # seq_mean_token_mean: (-1.2 + 0.6)/2; t1, t3 grads: per-token / 3 / 2.
        ("seq_mean_token_mean", -0.3, [0.0, -0.5 / 6, 0.0, 1.5 / 6, 0.0]),
        # seq_mean_token_sum: (-1.2 + 1.8)/2; grads per-token / 2.
        ("seq_mean_token_sum", 0.3, [0.0, -0.25, 0.0, 0.75, 0.0]),
        # seq_mean_token_sum_norm, L_max 5: 0.6 / (2 · 5); grads per-token / 10.
        ("seq_mean_token_sum_norm", 0.06, [0.0, -0.05, 0.0, 0.15, 0.0]),
    ],
)
def test_ppo_clip_sequence_aggregations(agg: str, loss: float, grads: list[float]) -> None:
    inp = _inp(**PPO_CASE)
    out = ppo_clip(inp, PPOClipConfig(agg=agg, norm_length=5))
    assert out.loss.item() == pytest.approx(loss)
    assert _grad(out, inp) == pytest.approx(grads)


def test_ppo_clip_ratio_at_the_boundary_keeps_its_gradient() -> None:
    # eps 0: the trust region is the single point r = 1. logp == old gives r = 1 exactly,
    # on the boundary: inside, so the gradient -A·r = -A flows (÷2 tokens). A ratio just
    # above it with A > 0 is clipped: gradient 0.
    inp = _inp(logp=[0.0, 0.0, 1e-3], old=[0.0, 0.0, 0.0], adv=[1.0, -1.0, 1.0])
    out = ppo_clip(inp, PPOClipConfig(eps_low=0.0, eps_high=0.0))
    assert _grad(out, inp) == pytest.approx([-1 / 3, 1 / 3, 0.0])
    assert out.metrics["loss/clip_frac"] == pytest.approx(1 / 3)


def test_ppo_clip_higher() -> None:
    # r = 1.25, A = +1: clipped at 1.2 with symmetric eps (loss -1.2, grad 0), inside the
    # clip-higher bound 1.28 (loss -1.25, grad -1.25).
    case = dict(logp=[math.log(1.25)], old=[0.0], adv=[1.0])
    sym = _inp(**case)
    out = ppo_clip(sym, PPOClipConfig(eps_low=0.2, eps_high=0.2))
    assert out.loss.item() == pytest.approx(-1.2)
    assert _grad(out, sym) == pytest.approx([0.0])
    dapo = _inp(**case)
    out = ppo_clip(dapo, PPOClipConfig(eps_low=0.2, eps_high=0.28))
    assert out.loss.item() == pytest.approx(-1.25)
    assert _grad(out, dapo) == pytest.approx([-1.25])


def test_ppo_dual_clip() -> None:
    # c = 3. A=-1, r=4: plain PPO leaves it unclipped (loss 4); dual clip caps it at
    # -c·A = 3 with gradient 0. A=-1, r=2 < c: loss 2, per-token grad 2. A=+1, r=4:
    # ordinary upper clip, loss -1.2, grad 0. token_mean: (3 + 2 - 1.2)/3.
    inp = _inp(logp=_logs(4.0, 2.0, 4.0), old=[0.0] * 3, adv=[-1.0, -1.0, 1.0])
    out = ppo_clip(inp, PPOClipConfig(dual_clip=3.0))
    assert out.loss.item() == pytest.approx(3.8 / 3)
    assert _grad(out, inp) == pytest.approx([0.0, 2 / 3, 0.0])
    assert out.metrics["loss/dual_clip_frac"] == pytest.approx(1 / 3)
    plain = ppo_clip(
        _inp(logp=_logs(4.0, 2.0, 4.0), old=[0.0] * 3, adv=[-1.0, -1.0, 1.0]), PPOClipConfig()
    )
    assert plain.loss.item() == pytest.approx(4.8 / 3)


# Decoupled PPO: behaviour μ (old), proximal π_prox, current π_θ, A = +1, eps 0.2.
#   t0  μ=0.25, prox=0.5, θ=0.75: weight 0.5/0.25 = 2, r = 0.75/0.5 = 1.5 clipped →
#       loss -2·1.2 = -2.4, grad 0
#   t1  μ=0.5, prox=0.4, θ=0.44: weight 0.8, r = 1.1 unclipped → loss -0.88, grad -0.88
DECOUPLED = dict(logp=_logs(0.75, 0.44), old=_logs(0.25, 0.5), adv=[1.0, 1.0])
PROXIMAL = _logs(0.5, 0.4)


def test_decoupled_ppo() -> None:
    inp = _inp(**DECOUPLED, proximal_logprobs_T=_t(PROXIMAL))
    out = ppo_clip(inp, PPOClipConfig(decoupled=True))
    assert out.loss.item() == pytest.approx((-2.4 - 0.88) / 2)
    assert _grad(out, inp) == pytest.approx([0.0, -0.44])
    assert out.metrics["loss/behav_weight_mean"] == pytest.approx(1.4)


def test_decoupled_weight_cap_drops_tokens() -> None:
    # Cap 1.5: t0's weight 2 exceeds it → weight 0; only t1 remains (still ÷2 tokens).
    inp = _inp(**DECOUPLED, proximal_logprobs_T=_t(PROXIMAL))
    out = ppo_clip(inp, PPOClipConfig(decoupled=True, decoupled_weight_cap=1.5))
    assert out.loss.item() == pytest.approx(-0.44)
    assert out.metrics["loss/behav_dropped_frac"] == pytest.approx(0.5)


def test_coupled_ppo_ignores_proximal() -> None:
    # Against μ directly: t0 r = 3 clipped → -1.2; t1 r = 0.88, A>0 unclipped → -0.88.
    inp = _inp(**DECOUPLED, proximal_logprobs_T=_t(PROXIMAL))
    assert ppo_clip(inp, PPOClipConfig()).loss.item() == pytest.approx((-1.2 - 0.88) / 2)


def test_decoupled_without_proximal_is_an_error() -> None:
    with pytest.raises(ValueError, match="proximal_logprobs_T"):
        ppo_clip(_inp(**DECOUPLED), PPOClipConfig(decoupled=True))


def test_is_weights_multiply_per_token_loss() -> None:
    # Two unclipped tokens r = 1, A = [1, -1] → per-token [-1, +1]; weights [2, 0.5] →
    # [-2, 0.5]; token_mean -0.75; grads [-2, 0.5]/2.
    inp = _inp(logp=[0.0, 0.0], old=[0.0, 0.0], adv=[1.0, -1.0], is_weights_T=_t([2.0, 0.5]))
    out = ppo_clip(inp, PPOClipConfig())
    assert out.loss.item() == pytest.approx(-0.75)
    assert _grad(out, inp) == pytest.approx([-1.0, 0.25])
    assert out.metrics["loss/is_weight_mean"] == pytest.approx(1.25)


# --- gspo ----------------------------------------------------------------------

# Three sequences, eps 0.25 both sides, old logprobs 0 so log r = logp.
#   seq 0: log r [0.1, 0.3] → mean 0.2, s = e^0.2, A=+1: inside 1.25 → loss -e^0.2;
#          each token's grad -A·s / (n=2) / (S=3)
#   seq 1: log r [0.5, 0.3, 0.1] (+ a masked 5.0) → mean 0.3, s = e^0.3 = 1.3499 > 1.25,
#          A=+1 → clipped as a whole: loss -1.25, grad 0 — although its last token's own
#          ratio e^0.1 would be inside a token-level trust region
#   seq 2: log r [-0.3], A=-1: s = e^-0.3 = 0.7408 < 0.75 → clipped: loss +0.75, grad 0
GSPO_CASE = dict(
    logp=[0.1, 0.3, 0.5, 0.3, 0.1, 5.0, -0.3],
    old=[0.0] * 7,
    adv=[1.0, 1.0, 1.0, 1.0, 1.0, 1.0, -1.0],
    mask=[True, True, True, True, True, False, True],
    seq=[0, 0, 1, 1, 1, 1, 2],
)


def test_gspo_sequence_level_clip() -> None:
    inp = _inp(**GSPO_CASE)
    out = gspo(inp, GSPOConfig(eps_low=0.25, eps_high=0.25))
    s0 = math.exp(0.2)
    assert out.loss.item() == pytest.approx((-s0 - 1.25 + 0.75) / 3)
    g0 = -s0 / 2 / 3
    assert _grad(out, inp) == pytest.approx([g0, g0, 0.0, 0.0, 0.0, 0.0, 0.0])
    # Clipped tokens: the 3 counted of seq 1 (high) and seq 2's one (low), of 6.
    assert out.metrics["loss/clip_high_frac"] == pytest.approx(3 / 6)
    assert out.metrics["loss/clip_low_frac"] == pytest.approx(1 / 6)


def test_gspo_default_bounds_are_tight() -> None:
    # Paper bounds 3e-4 / 4e-4: s = e^0.2 is far outside, so seq 0 is clipped too.
    inp = _inp(**GSPO_CASE)
    out = gspo(inp, GSPOConfig())
    assert _grad(out, inp) == pytest.approx([0.0] * 7)
    assert out.loss.item() == pytest.approx((-(1 + 4e-4) * 2 + (1 - 3e-4)) / 3)


# --- cispo ---------------------------------------------------------------------

# eps_low 1.0 (no lower bound), eps_high 0.28.
#   t0  r = 0.9/0.5 = 1.8 → weight 1.28, A=+1: loss -1.28·ln0.9, grad -1.28 (not 0: the
#       clip bounds the weight, the token keeps its gradient)
#   t1  r = 0.05/0.5 = 0.1 → weight 0.1, A=-2: loss -0.1·(-2)·ln0.05, grad -w·A = 0.2.
#       Without the stop-gradient the grad would be -A·r·(ln0.05 + 1) ≈ -0.399.
CISPO_CASE = dict(logp=_logs(0.9, 0.05), old=_logs(0.5, 0.5), adv=[1.0, -2.0])


def test_cispo_stop_gradient_on_clipped_weight() -> None:
    inp = _inp(**CISPO_CASE)
    out = cispo(inp, CISPOConfig())
    expected = (-1.28 * math.log(0.9) + 0.2 * math.log(0.05)) / 2
    assert out.loss.item() == pytest.approx(expected)
    assert _grad(out, inp) == pytest.approx([-0.64, 0.1])
    assert out.metrics["loss/clip_high_frac"] == pytest.approx(0.5)


def test_cispo_lower_bound() -> None:
    # eps_low 0.5 → the weight of t1 is raised from 0.1 to 0.5: grad -0.5·(-2)/2 = 0.5.
    inp = _inp(**CISPO_CASE)
    out = cispo(inp, CISPOConfig(eps_low=0.5))
    assert _grad(out, inp) == pytest.approx([-0.64, 0.5])
    assert out.metrics["loss/clip_low_frac"] == pytest.approx(0.5)


# --- reinforce -----------------------------------------------------------------


def test_reinforce() -> None:
    # -A·logp: -(2·ln0.5) - (-1·ln0.25) = 2ln2 - 2ln2 = 0; grads -A/2 = [-1, 0.5].
    inp = _inp(logp=_logs(0.5, 0.25), old=[0.0, 0.0], adv=[2.0, -1.0])
    out = reinforce(inp, ReinforceConfig())
    assert out.loss.item() == pytest.approx(0.0, abs=1e-12)
    assert _grad(out, inp) == pytest.approx([-1.0, 0.5])


# --- sapo ----------------------------------------------------------------------


# The gate and its derivative in plain floats: f(r) = 4/τ·σ(τ(r - 1)),
# d f / d log π = 4·σ(1 - σ)·r. Two sequences, old logprobs 0 so r = π:
#   t0  seq 0  r = 1,   A = +1, τ 1     f = 2,          d = 1 (the plain policy gradient)
#   t1  seq 0  r = 2,   A = +1, τ 1     f = 4σ(1),      d = 8σ(1)(1 - σ(1))
#   t2  seq 1  r = 0.5, A = -1, τ 1.05  f = 4/1.05·σ(-0.525)
#   t3  seq 1  r = 1.5, A = 0,  τ 1.05  loss 0, grad 0
#   t4  seq 1  masked, log r = 40: beyond exp's comfort, must stay out (no nan)
def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def _gate(r: float, tau: float) -> tuple[float, float]:
    sig = _sigmoid(tau * (r - 1.0))
    return 4.0 / tau * sig, 4.0 * sig * (1.0 - sig) * r


SAPO_CASE = dict(
    logp=[0.0, math.log(2.0), math.log(0.5), math.log(1.5), 40.0],
    old=[0.0] * 5,
    adv=[1.0, 1.0, -1.0, 0.0, 1.0],
    mask=[True, True, True, True, False],
    seq=[0, 0, 1, 1, 1],
)


def test_sapo_soft_gate() -> None:
    inp = _inp(**SAPO_CASE)
    out = sapo(inp, SAPOConfig())
    (f0, d0), (f1, d1), (f2, d2) = _gate(1.0, 1.0), _gate(2.0, 1.0), _gate(0.5, 1.05)
    assert (f0, d0) == pytest.approx((2.0, 1.0))
    # Per-token loss -f·A; seq_mean_token_mean over two tokens per sequence, two sequences.
    assert out.loss.item() == pytest.approx(((-f0 - f1) / 2 + (f2 + 0.0) / 2) / 2)
    # Per-token grad -A·d, ÷ 2 tokens ÷ 2 sequences.
    assert _grad(out, inp) == pytest.approx([-d0 / 4, -d1 / 4, d2 / 4, 0.0, 0.0])


def test_sapo_larger_tau_fades_faster() -> None:
    # r = 2, A = +1: the gradient at τ = 2 is smaller than at τ = 1 (8σ(2)(1-σ(2)) vs
    # 8σ(1)(1-σ(1))): off-policy tokens are damped more.
    grads = []
    for tau in (1.0, 2.0):
        inp = _inp(logp=[math.log(2.0)], old=[0.0], adv=[1.0])
        grads.append(_grad(sapo(inp, SAPOConfig(tau_pos=tau)), inp)[0])
    assert grads == pytest.approx([-_gate(2.0, 1.0)[1], -_gate(2.0, 2.0)[1]])
    assert abs(grads[1]) < abs(grads[0])


# --- gmpo ----------------------------------------------------------------------

# clip 0.4 both sides, old logprobs 0 so log r = logp. Three sequences:
#   seq 0  A=+1  log r [0.2, 0.6, -0.7] → [0.2, 0.4 (clipped high), -0.7 (A > 0: the low
#          side does not bind)], mean -0.1/3, s0 = e^(-0.1/3); loss -s0;
#          grads -A·s0/3 on t0 and t2, 0 on t1
#   seq 1  A=-1  log r [-0.6, 0.5, 0.1] (+ a masked 5.0) → [-0.4 (clipped low), 0.5
#          (A < 0: the high side does not bind), 0.1], mean 0.2/3, s1 = e^(0.2/3); loss +s1;
#          grads s1/3 on t4 and t5, 0 on t3
#   seq 2  A=0   loss 0, grad 0
# The mean over S = 3 sequences divides everything by 3.
GMPO_CASE = dict(
    logp=[0.2, 0.6, -0.7, -0.6, 0.5, 0.1, 5.0, 0.3],
    old=[0.0] * 8,
    adv=[1.0, 1.0, 1.0, -1.0, -1.0, -1.0, -1.0, 0.0],
    mask=[True, True, True, True, True, True, False, True],
    seq=[0, 0, 0, 1, 1, 1, 1, 2],
)


def test_gmpo_geometric_mean_of_clipped_ratios() -> None:
    inp = _inp(**GMPO_CASE)
    out = gmpo(inp, GMPOConfig())
    s0, s1 = math.exp(-0.1 / 3), math.exp(0.2 / 3)
    assert out.loss.item() == pytest.approx((-s0 + s1 + 0.0) / 3)
    g0, g1 = -s0 / 3 / 3, s1 / 3 / 3
    assert _grad(out, inp) == pytest.approx([g0, 0.0, g0, 0.0, g1, g1, 0.0, 0.0])
    # One token clipped high (t1), one low (t3), of seven counted.
    assert out.metrics["loss/clip_high_frac"] == pytest.approx(1 / 7)
    assert out.metrics["loss/clip_low_frac"] == pytest.approx(1 / 7)


def test_gmpo_without_clipping_is_the_geometric_mean() -> None:
    # Wide clip: seq 0's s = exp(mean(0.2, 0.6, -0.7)) = e^(0.1/3) and every counted token
    # gets gradient -A·s/3/S.
    inp = _inp(**GMPO_CASE)
    out = gmpo(inp, GMPOConfig(clip_low=10.0, clip_high=10.0))
    s0, s1 = math.exp(0.1 / 3), math.exp(0.0)
    assert out.loss.item() == pytest.approx((-s0 + s1) / 3)
    g0, g1 = -s0 / 9, s1 / 9
    assert _grad(out, inp) == pytest.approx([g0, g0, g0, g1, g1, g1, 0.0, 0.0])


@pytest.mark.parametrize(
    "cfg, message",
    [
        (SAPOConfig(tau_pos=0.0), "algo.loss.tau_pos=0.0 must be > 0.0"),
        (SAPOConfig(tau_neg=-1.0), "algo.loss.tau_neg=-1.0 must be > 0.0"),
        (GMPOConfig(clip_low=-0.1), "algo.loss.clip_low=-0.1 must be >= 0.0"),
        (GMPOConfig(clip_high=-0.1), "algo.loss.clip_high=-0.1 must be >= 0.0"),
    ],
)
def test_bad_sapo_and_gmpo_options(cfg, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_policy_loss(cfg)


def test_masked_tokens_get_no_gradient_in_every_loss() -> None:
    for name in POLICY_LOSSES.names():
        inp = _inp(**PPO_CASE)
        grads = _grad(build_policy_loss(name)(inp), inp)
        assert grads[4] == 0.0, name
        assert all(math.isfinite(g) for g in grads), name


def test_input_shapes_are_checked() -> None:
    with pytest.raises(ValueError, match="advantages_T has 2 tokens"):
        _inp(logp=[0.0, 0.0, 0.0], old=[0.0] * 3, adv=[1.0, 1.0], seq=[0, 0, 0])
    with pytest.raises(ValueError, match="loss_mask_T must be bool"):
        PolicyLossInput(_t([0.0]), _t([0.0]), _t([1.0]), _t([1.0]), torch.tensor([0]), 1)


# --- KL estimators ---------------------------------------------------------------

# Token 0: p = 0.5, ref = 0.25 → log(ref/p) = -ln2: k1 = ln2, k2 = (ln2)^2/2,
#          k3 = (0.5 - 1) + ln2 = 0.193147
# Token 1: p = 0.2, ref = 0.4  → log(ref/p) = +ln2: k1 = -ln2, k2 = (ln2)^2/2,
#          k3 = (2 - 1) - ln2 = 0.306853
LN2 = math.log(2.0)
KL_P = [math.log(0.5), math.log(0.2)]
KL_REF = [math.log(0.25), math.log(0.4)]


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("k1", [LN2, -LN2]),
        ("k2", [LN2**2 / 2, LN2**2 / 2]),
        ("k3", [LN2 - 0.5, 1 - LN2]),
    ],
)
def test_kl_estimators(kind: str, expected: list[float]) -> None:
    kl = kl_penalty(torch.tensor(KL_P, dtype=F64), torch.tensor(KL_REF, dtype=F64), kind)
    assert kl.tolist() == pytest.approx(expected)


def test_kl_term_and_k3_gradient() -> None:
    logp = torch.tensor(KL_P, dtype=F64, requires_grad=True)
    inp = KLInput(
        logp, torch.tensor(KL_REF, dtype=F64), torch.tensor([True, True]), torch.tensor([0, 1]), 2
    )
    out = kl_term(inp, KLConfig(coef=0.1))
    # k3 mean: (ln2 - 0.5 + 1 - ln2)/2 = 0.25; × 0.1.
    assert out.loss.item() == pytest.approx(0.025)
    assert out.metrics["kl/value"] == pytest.approx(0.25)
    # d k3 / d logp = 1 - ref/p: [1 - 0.5, 1 - 2] → × 0.1 / 2.
    (grad,) = torch.autograd.grad(out.loss, logp)
    assert grad.tolist() == pytest.approx([0.025, -0.05])
    # seq_mean_token_sum_norm, L_max 4: (ln2 - 0.5 + 1 - ln2) / (2 · 4) = 0.0625.
    norm = kl_term(inp, KLConfig(coef=1.0, agg="seq_mean_token_sum_norm", norm_length=4))
    assert norm.loss.item() == pytest.approx(0.0625)
    # clamp 0.2 caps token 1's 0.306853.
    clamped = kl_term(inp, KLConfig(coef=1.0, clamp=0.2))
    assert clamped.loss.item() == pytest.approx((LN2 - 0.5 + 0.2) / 2)


# IS-corrected KL, behaviour μ = [0.25, 0.4] → weights π/μ = [2, 0.5]:
#   value  w·k3 = [2(ln2 - 0.5), 0.5(1 - ln2)], token_mean over 2
#   grad   w·k3 = (ref - p)/μ - (p/μ)·log(ref/p), so d/dlogp = -(p/μ)·log(ref/p) = w·log(p/ref):
#          [2·ln2, 0.5·(-ln2)] / 2. Detaching w would give w·(1 - ref/p) = [1, -0.5] / 2.
KL_MU = [math.log(0.25), math.log(0.4)]


def _kl_inp(behaviour=KL_MU) -> KLInput:
    return KLInput(
        logprobs_T=torch.tensor(KL_P, dtype=F64, requires_grad=True),
        ref_logprobs_T=torch.tensor(KL_REF, dtype=F64),
        loss_mask_T=torch.tensor([True, True]),
        seq_ids_T=torch.tensor([0, 1]),
        num_seqs=2,
        behaviour_logprobs_T=None if behaviour is None else torch.tensor(behaviour, dtype=F64),
    )


def test_kl_importance_sampling_value_and_gradient() -> None:
    inp = _kl_inp()
    out = kl_term(inp, KLConfig(coef=0.1, importance_sampling=True))
    value = (2 * (LN2 - 0.5) + 0.5 * (1 - LN2)) / 2
    assert out.metrics["kl/value"] == pytest.approx(value)
    assert out.loss.item() == pytest.approx(0.1 * value)
    assert out.metrics["kl/is_weight_mean"] == pytest.approx(1.25)
    (grad,) = torch.autograd.grad(out.loss, inp.logprobs_T)
    assert grad.tolist() == pytest.approx([0.1 * 2 * LN2 / 2, 0.1 * 0.5 * -LN2 / 2])


def test_kl_importance_sampling_is_off_by_default() -> None:
    # The behaviour logprobs are ignored without the flag: plain k3 mean 0.25.
    assert kl_term(_kl_inp(), KLConfig(coef=1.0)).loss.item() == pytest.approx(0.25)


def test_kl_importance_sampling_needs_behaviour_logprobs() -> None:
    with pytest.raises(ValueError, match="importance_sampling=true needs KLInput.behaviour"):
        kl_term(_kl_inp(behaviour=None), KLConfig(coef=0.1, importance_sampling=True))


@pytest.mark.parametrize(
    "cfg, key",
    [
        (PPOClipConfig(agg="seq_mean_token_sum_norm"), "algo.loss"),
        (GSPOConfig(agg="seq_mean_token_sum_norm", norm_length=-1), "algo.loss"),
        (CISPOConfig(agg="seq_mean_token_sum_norm"), "algo.loss"),
        (ReinforceConfig(agg="seq_mean_token_sum_norm"), "algo.loss"),
        (KLConfig(agg="seq_mean_token_sum_norm"), "algo.kl"),
    ],
)
def test_norm_mode_needs_norm_length(cfg, key: str) -> None:
    with pytest.raises(ValueError) as info:
        cfg.validate(key)
    message = str(info.value)
    assert f"{key}.norm_length={cfg.norm_length}" in message
    assert "rollout.max_new_tokens" in message
    cfg.norm_length = 4096
    cfg.validate(key)


def test_unknown_kl_kind() -> None:
    with pytest.raises(ValueError, match="'k4'"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k4")
