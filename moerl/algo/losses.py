"""Policy losses: per-token surrogate terms, weighted by the IS correction, then aggregated.

# T tokens in the batch, S sequences

Every loss computes a per-token term loss_T, multiplies it by `is_weights_T` when given
(the output of an IS correction, moerl.algo.correction), and reduces it with `aggregate`
(moerl.algo.reduce) in the mode its config names. Advantages are per token: broadcast a
per-sequence advantage with `advantages_S[seq_ids_T]`.

Clipping convention (PPO, GSPO): a token is clipped only when its ratio is strictly
outside the trust region on the side its advantage pushes towards; a ratio exactly at
1 ± eps is inside and keeps its gradient. Clipped tokens contribute a constant (zero
gradient), as in min(r·A, clip(r)·A).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from moerl.algo.config import (
    CISPOConfig,
    GMPOConfig,
    GSPOConfig,
    PPOClipConfig,
    ReinforceConfig,
    SAPOConfig,
)
from moerl.algo.kl import mismatch_kl
from moerl.algo.reduce import (
    aggregate,
    check_tokens,
    masked_max,
    masked_mean,
    segment_mean,
    to_floats,
)
from moerl.common.registry import Registry

# SAPO's log ratio is clamped to ±this before exp, as verl: past it the gate is flat, and
# exp overflowing to inf would make the gate's backward 0·inf = nan.
MAX_LOG_RATIO = 20.0

__all__ = [
    "POLICY_LOSSES",
    "PolicyLossInput",
    "PolicyLossOutput",
    "aggregate",
    "build_policy_loss",
    "cispo",
    "gmpo",
    "gspo",
    "ppo_clip",
    "reinforce",
    "sapo",
]


@dataclass
class PolicyLossInput:
    """Logprobs of the trained tokens under the current, old (and proximal) policies."""

    logprobs_T: torch.Tensor
    """float [T]: current policy logprob of each token; requires grad."""
    old_logprobs_T: torch.Tensor
    """float [T]: logprob under the policy the ratio is taken against (detached): the
    trainer's pre-update policy, or the rollout engine's (behaviour) logprobs."""
    advantages_T: torch.Tensor
    """float [T]: advantage of each token (detached)."""
    loss_mask_T: torch.Tensor
    """bool [T]: tokens that count (response tokens)."""
    seq_ids_T: torch.Tensor
    """int64 [T]: sequence of each token, 0..S-1."""
    num_seqs: int
    """S, the number of sequences; the sequence aggregations divide by it."""
    is_weights_T: torch.Tensor | None = None
    """float [T] or None: per-token weights from the IS correction (detached; 0 = dropped)."""
    proximal_logprobs_T: torch.Tensor | None = None
    """float [T] or None: logprobs under the proximal policy, for decoupled PPO (AReaL)."""

    def __post_init__(self) -> None:
        check_tokens(
            "PolicyLossInput",
            self.num_seqs,
            logprobs_T=self.logprobs_T,
            old_logprobs_T=self.old_logprobs_T,
            advantages_T=self.advantages_T,
            loss_mask_T=self.loss_mask_T,
            seq_ids_T=self.seq_ids_T,
            is_weights_T=self.is_weights_T,
            proximal_logprobs_T=self.proximal_logprobs_T,
        )
        if self.loss_mask_T.dtype != torch.bool:
            raise ValueError(
                f"PolicyLossInput: loss_mask_T must be bool, got {self.loss_mask_T.dtype}"
            )


@dataclass
class PolicyLossOutput:
    """The scalar to backpropagate and scalars worth logging."""

    loss: torch.Tensor
    """Scalar loss (minimise it)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """e.g. 'loss/clip_frac', 'loss/approx_kl' (k3 of old vs current over counted tokens)."""


POLICY_LOSSES: Registry[PolicyLossInput, PolicyLossOutput] = Registry("policy loss", "algo.loss")


def build_policy_loss(spec: Any) -> Callable[[PolicyLossInput], PolicyLossOutput]:
    """Config (name, options dataclass, mapping or `_target_`) → `fn(PolicyLossInput)`."""
    return POLICY_LOSSES.build(spec)


def _finish(
    inp: PolicyLossInput,
    loss_T: torch.Tensor,
    agg: str,
    norm_length: int,
    metrics: dict[str, torch.Tensor],
    anchor_T: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """Apply the correction's weights, aggregate, and add the metrics every loss reports.

    approx_kl is the k3 estimate of KL(anchor || current) where anchor is the policy the
    ratio is taken against (old_logprobs_T unless given).
    """
    mask_T = inp.loss_mask_T
    if inp.is_weights_T is not None:
        w_T = inp.is_weights_T.detach()
        loss_T = loss_T * w_T
        metrics["loss/is_weight_mean"] = masked_mean(w_T, mask_T)
    loss = aggregate(loss_T, mask_T, inp.seq_ids_T, inp.num_seqs, agg, norm_length=norm_length)
    metrics["loss/value"] = loss.detach()
    anchor_T = inp.old_logprobs_T if anchor_T is None else anchor_T
    metrics["loss/approx_kl"] = mismatch_kl(anchor_T, inp.logprobs_T, mask_T)
    return PolicyLossOutput(loss=loss, metrics=to_floats(metrics))


def _clip(
    ratio_T: torch.Tensor, adv_T: torch.Tensor, eps_low: float, eps_high: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-min(r·A, clip(r)·A) per token, and where the upper / lower bound was active."""
    lower, upper = 1.0 - eps_low, 1.0 + eps_high
    high_T = (adv_T > 0) & (ratio_T > upper)
    low_T = (adv_T < 0) & (ratio_T < lower)
    # clamp has zero gradient strictly outside [lower, upper], which is where it is used.
    loss_T = torch.where(high_T | low_T, -adv_T * ratio_T.clamp(lower, upper), -adv_T * ratio_T)
    return loss_T, high_T, low_T


def _clip_metrics(
    ratio_T: torch.Tensor, high_T: torch.Tensor, low_T: torch.Tensor, mask_T: torch.Tensor
) -> dict[str, torch.Tensor]:
    ratio_T = ratio_T.detach()
    return {
        "loss/clip_frac": masked_mean((high_T | low_T).float(), mask_T),
        "loss/clip_high_frac": masked_mean(high_T.float(), mask_T),
        "loss/clip_low_frac": masked_mean(low_T.float(), mask_T),
        "loss/ratio_mean": masked_mean(ratio_T, mask_T),
        "loss/ratio_max": masked_max(ratio_T, mask_T),
    }


@POLICY_LOSSES.register("ppo_clip", PPOClipConfig)
def ppo_clip(inp: PolicyLossInput, cfg: PPOClipConfig) -> PolicyLossOutput:
    """PPO's clipped surrogate; clip-higher when eps_high > eps_low; optional dual clip.

    Decoupled (AReaL, after Hilton et al. 2022), with behaviour policy μ = old_logprobs_T
    and proximal policy π_prox = proximal_logprobs_T (the trainer's weights before this
    update, recomputed on the batch):

        loss_T = -sg(π_prox / μ) · min(r·A, clip(r)·A),   r = π_θ / π_prox

    so the trust region is centred on the proximal policy however stale the sample is, and
    the behaviour→proximal gap is corrected by importance weighting instead of clipping.
    A correction's is_weights_T still multiplies on top; since the behaviour weight already
    covers the rollout→trainer gap, decoupled PPO usually runs with correction=none.
    """
    adv_T, mask_T = inp.advantages_T, inp.loss_mask_T
    metrics: dict[str, torch.Tensor] = {}
    anchor_T = inp.old_logprobs_T
    behav_w_T = None
    if cfg.decoupled:
        if inp.proximal_logprobs_T is None:
            raise ValueError(
                "algo.loss.decoupled=true needs PolicyLossInput.proximal_logprobs_T (the "
                "pre-update trainer's logprobs); pass them or set decoupled=false"
            )
        anchor_T = inp.proximal_logprobs_T.detach()
        behav_w_T = torch.exp(anchor_T - inp.old_logprobs_T.detach())
        if cfg.decoupled_weight_cap is not None:
            dropped_T = behav_w_T > cfg.decoupled_weight_cap
            behav_w_T = torch.where(dropped_T, 0.0, behav_w_T)
            metrics["loss/behav_dropped_frac"] = masked_mean(dropped_T.float(), mask_T)
        metrics["loss/behav_weight_mean"] = masked_mean(behav_w_T, mask_T)
    ratio_T = torch.exp(inp.logprobs_T - anchor_T.detach())
    loss_T, high_T, low_T = _clip(ratio_T, adv_T, cfg.eps_low, cfg.eps_high)
    if cfg.dual_clip is not None:
        # For A < 0 the surrogate -r·A grows without bound in r; cap it at -c·A.
        dual_T = (adv_T < 0) & (ratio_T > cfg.dual_clip)
        loss_T = torch.where(dual_T, -adv_T * cfg.dual_clip, loss_T)
        metrics["loss/dual_clip_frac"] = masked_mean(dual_T.float(), mask_T)
    if behav_w_T is not None:
        loss_T = loss_T * behav_w_T
    metrics.update(_clip_metrics(ratio_T, high_T, low_T, mask_T))
    return _finish(inp, loss_T, cfg.agg, cfg.norm_length, metrics, anchor_T=anchor_T)


@POLICY_LOSSES.register("gspo", GSPOConfig)
def gspo(inp: PolicyLossInput, cfg: GSPOConfig) -> PolicyLossOutput:
    """GSPO: the ratio of a sequence is s = exp(mean over its counted tokens of log r),
    clipped at the sequence level by the sign of the advantage.

    Written in the paper's GSPO-token form, s_T = sg(s) · π_θ / sg(π_θ): every token of a
    sequence carries the value s and the gradient s·∇log π_θ(token), so with a constant
    advantage per sequence and 'seq_mean_token_mean' this is exactly the sequence-level
    objective -mean_i min(s_i·A_i, clip(s_i)·A_i).
    """
    mask_T = inp.loss_mask_T
    log_r_T = (inp.logprobs_T - inp.old_logprobs_T).detach()
    seq_log_r_S = segment_mean(log_r_T, mask_T, inp.seq_ids_T, inp.num_seqs)
    log_s_T = seq_log_r_S[inp.seq_ids_T] + inp.logprobs_T - inp.logprobs_T.detach()
    s_T = torch.exp(log_s_T)
    loss_T, high_T, low_T = _clip(s_T, inp.advantages_T, cfg.eps_low, cfg.eps_high)
    return _finish(inp, loss_T, cfg.agg, cfg.norm_length, _clip_metrics(s_T, high_T, low_T, mask_T))


@POLICY_LOSSES.register("cispo", CISPOConfig)
def cispo(inp: PolicyLossInput, cfg: CISPOConfig) -> PolicyLossOutput:
    """CISPO (MiniMax-M1): loss_T = -sg(clip(r, 1 - eps_low, 1 + eps_high)) · A · log π_θ.

    The clip bounds the IS weight, not the update: a token outside the trust region keeps
    its REINFORCE gradient, scaled by the bound.
    """
    mask_T = inp.loss_mask_T
    ratio_T = torch.exp(inp.logprobs_T.detach() - inp.old_logprobs_T.detach())
    lower, upper = max(1.0 - cfg.eps_low, 0.0), 1.0 + cfg.eps_high
    weight_T = ratio_T.clamp(lower, upper)
    loss_T = -weight_T * inp.advantages_T * inp.logprobs_T
    high_T, low_T = ratio_T > upper, ratio_T < lower
    return _finish(
        inp, loss_T, cfg.agg, cfg.norm_length, _clip_metrics(ratio_T, high_T, low_T, mask_T)
    )


@POLICY_LOSSES.register("reinforce", ReinforceConfig)
def reinforce(inp: PolicyLossInput, cfg: ReinforceConfig) -> PolicyLossOutput:
    """REINFORCE: loss_T = -A · log π_θ; off-policy use goes through is_weights_T (TOPR)."""
    loss_T = -inp.advantages_T * inp.logprobs_T
    return _finish(inp, loss_T, cfg.agg, cfg.norm_length, {})


@POLICY_LOSSES.register("sapo", SAPOConfig)
def sapo(inp: PolicyLossInput, cfg: SAPOConfig) -> PolicyLossOutput:
    """SAPO (Gao et al. 2025, "Soft Adaptive Policy Optimization", arXiv 2511.20347):

        loss_T = -f(r)·A,   f(r) = σ(τ·(r - 1))·4/τ,   r = π_θ / π_old,
        τ = tau_pos where A > 0, tau_neg where A <= 0

    The gate replaces the hard clip: d f / d log π_θ = 4·σ'(τ(r - 1))·r is 1 on-policy
    (r = 1, the plain policy gradient) and fades smoothly as r leaves 1, faster for larger
    τ. As verl's compute_policy_loss_sapo, the log ratio is clamped to ±20 first.
    """
    adv_T, mask_T = inp.advantages_T, inp.loss_mask_T
    log_r_T = (inp.logprobs_T - inp.old_logprobs_T.detach()).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio_T = torch.exp(log_r_T)
    tau_T = torch.full_like(ratio_T, cfg.tau_neg).masked_fill(adv_T > 0, cfg.tau_pos)
    gate_T = torch.sigmoid(tau_T * (ratio_T - 1.0)) * 4.0 / tau_T
    loss_T = -gate_T * adv_T
    ratio_T = ratio_T.detach()
    metrics = {
        "loss/gate_mean": masked_mean(gate_T.detach(), mask_T),
        "loss/ratio_mean": masked_mean(ratio_T, mask_T),
        "loss/ratio_max": masked_max(ratio_T, mask_T),
    }
    return _finish(inp, loss_T, cfg.agg, cfg.norm_length, metrics)


@POLICY_LOSSES.register("gmpo", GMPOConfig)
def gmpo(inp: PolicyLossInput, cfg: GMPOConfig) -> PolicyLossOutput:
    """GMPO (Zhao et al. 2025, "Geometric-Mean Policy Optimization", arXiv 2507.20673):
    the geometric mean of the clipped token ratios replaces GRPO's arithmetic mean.

        ℓ_t = sgn(A_t) · min(sgn(A_t)·log r_t, sgn(A_t)·clip(log r_t, -clip_low, clip_high))
        s_i = exp(mean_{t in o_i} ℓ_t),   A_i = mean_{t in o_i} A_t
        loss = -(1/S) Σ_i A_i · s_i

    The clip is in log space and binds only on the side the advantage pushes (above for
    A > 0, below for A < 0), as PPO's; a clipped token gets no gradient while the rest of
    its sequence keeps its own. This is verl's compute_policy_loss_geo_mean (after the
    authors' code). Every token of sequence i carries -A_i·s_i, so 'seq_mean_token_mean'
    is exactly the objective above. is_weights_T multiply per token as in every loss: a
    sequence's weight is then the arithmetic mean of its tokens' weights, where verl takes
    the geometric mean; with a sequence- or geometric-level correction they agree.
    """
    adv_T, mask_T, seq_T, S = inp.advantages_T, inp.loss_mask_T, inp.seq_ids_T, inp.num_seqs
    log_r_T = inp.logprobs_T - inp.old_logprobs_T.detach()
    sign_T = torch.sign(adv_T)
    bounded_T = log_r_T.clamp(-cfg.clip_low, cfg.clip_high)
    clipped_log_r_T = sign_T * torch.minimum(sign_T * log_r_T, sign_T * bounded_T)
    s_S = torch.exp(segment_mean(clipped_log_r_T, mask_T, seq_T, S))
    adv_S = segment_mean(adv_T, mask_T, seq_T, S)
    loss_T = (-adv_S * s_S)[seq_T]
    log_r_T = log_r_T.detach()
    high_T = (adv_T > 0) & (log_r_T > cfg.clip_high)
    low_T = (adv_T < 0) & (log_r_T < -cfg.clip_low)
    metrics = _clip_metrics(torch.exp(log_r_T), high_T, low_T, mask_T)
    metrics["loss/seq_ratio_mean"] = masked_mean(s_S.detach()[seq_T], mask_T)
    return _finish(inp, loss_T, cfg.agg, cfg.norm_length, metrics)
