"""Importance-sampling corrections for the gap between the rollout engine and the trainer.

# T tokens in the batch, S sequences

The engine sampled each token with logprob `rollout_logprobs_T` (possibly several policy
versions ago); the trainer scores it as `trainer_logprobs_T`. A correction turns
ratio = exp(trainer - rollout), taken at a level (token / sequence / geometric, see
correction_config.py), into per-token `weights_T` and a `keep_T` mask.

How the output plugs into a loss: pass `weights_T` as PolicyLossInput.is_weights_T. The
weights are already 0 where keep_T is False, so dropped tokens stay in the loss's
normaliser (the papers' form: IcePop's M(k) = 0 inside the 1/|o| average). AND keep_T into
loss_mask_T as well only if dropped tokens should also leave the normaliser.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from moerl.algo.correction_config import (
    LEVELS,
    CorrectionConfig,
    IcePopConfig,
    MISConfig,
    OPSMConfig,
    TISConfig,
    TOPRConfig,
    VersionGapConfig,
)
from moerl.algo.kl import mismatch_kl
from moerl.algo.reduce import (
    check_tokens,
    masked,
    masked_max,
    masked_mean,
    segment_count,
    segment_mean,
    segment_sum,
    to_floats,
)
from moerl.common.checks import choice_error
from moerl.common.registry import Registry


@dataclass
class CorrectionInput:
    """Trainer and rollout logprobs of the sampled tokens, and who sampled them."""

    trainer_logprobs_T: torch.Tensor
    """float [T]: trainer logprob of each token (detached inside the corrections)."""
    rollout_logprobs_T: torch.Tensor
    """float [T]: engine logprob the token was sampled with."""
    loss_mask_T: torch.Tensor
    """bool [T]: tokens that count; every other token gets weight 0 and keep False."""
    seq_ids_T: torch.Tensor
    """int64 [T]: sequence of each token, 0..S-1."""
    num_seqs: int
    """S, the number of sequences."""
    versions_T: torch.Tensor | None = None
    """int64 [T]: policy version that sampled each token; needed by version_gap."""
    current_version: int | None = None
    """The trainer's policy version now; needed by version_gap."""
    advantages_T: torch.Tensor | None = None
    """float [T]: advantage of each token; needed by topr and opsm (their rules depend on
    the sign)."""

    def __post_init__(self) -> None:
        check_tokens(
            "CorrectionInput",
            self.num_seqs,
            trainer_logprobs_T=self.trainer_logprobs_T,
            rollout_logprobs_T=self.rollout_logprobs_T,
            loss_mask_T=self.loss_mask_T,
            seq_ids_T=self.seq_ids_T,
            versions_T=self.versions_T,
            advantages_T=self.advantages_T,
        )
        if self.loss_mask_T.dtype != torch.bool:
            raise ValueError(
                f"CorrectionInput: loss_mask_T must be bool, got {self.loss_mask_T.dtype}"
            )


@dataclass
class CorrectionOutput:
    """Per-token weights and keep mask for the loss, and scalars worth logging."""

    weights_T: torch.Tensor
    """float [T], detached: the IS weight of each token; 0 where keep_T is False."""
    keep_T: torch.Tensor
    """bool [T]: counted tokens the correction keeps (a subset of loss_mask_T)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """'is/weight_mean', 'is/weight_max', 'is/masked_frac', 'is/clipped_frac' (tis, topr),
    'is/mismatch_kl' (k3 estimate of KL(rollout || trainer) per counted token),
    'is/batch_norm_factor' (the mean divided out by batch_normalize)."""


CORRECTIONS: Registry[CorrectionInput, CorrectionOutput] = Registry("correction", "correction")


def build_correction(spec: Any) -> Callable[[CorrectionInput], CorrectionOutput]:
    """Config (name, options dataclass, mapping or `_target_`) → `fn(CorrectionInput)`."""
    return CORRECTIONS.build(spec)


def log_ratio_at_level(inp: CorrectionInput, level: str) -> torch.Tensor:
    """log(trainer / rollout) per token at `level`, 0 on tokens that do not count: [T].

    token: the token's own; sequence: the sum over its sequence (log of the product);
    geometric: the mean over its sequence's counted tokens.
    """
    mask_T, seq_T, S = inp.loss_mask_T, inp.seq_ids_T, inp.num_seqs
    log_r_T = masked((inp.trainer_logprobs_T - inp.rollout_logprobs_T).detach(), mask_T)
    if level == "token":
        return log_r_T
    if level == "sequence":
        return masked(segment_sum(log_r_T, seq_T, S)[seq_T], mask_T)
    if level == "geometric":
        return masked(segment_mean(log_r_T, mask_T, seq_T, S)[seq_T], mask_T)
    raise choice_error("correction level", level, LEVELS)


def normalize_weights(
    inp: CorrectionInput, weights_T: torch.Tensor, level: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights divided by their batch mean, and that mean (verl's rollout_is_batch_normalize).

        token                 w_t / mean_{t counted} w_t
        sequence, geometric   w_t / mean_{i: seq has a counted token} w_i

    `weights_T` must already be 0 where the correction drops a token: dropped tokens stay in
    the mean, as they stay in the loss's normaliser, so the weights of a batch sum to its
    counted tokens (token) or to its sequences (sequence, geometric). At the sequence levels
    every token of sequence i carries w_i, so its mean over the sequence's counted tokens
    is w_i. A mean <= 1e-8 (every token dropped) leaves the weights as they are, as verl.
    The trainer calls the correction once over the whole step, so "batch" is the step.
    """
    mask_T, seq_T, S = inp.loss_mask_T, inp.seq_ids_T, inp.num_seqs
    weights_T = masked(weights_T, mask_T)
    if level == "token":
        mean = masked_mean(weights_T, mask_T)
    else:
        w_S = segment_mean(weights_T, mask_T, seq_T, S)
        counted_S = segment_count(mask_T, seq_T, S) > 0
        mean = w_S.sum() / counted_S.sum().clamp(min=1).to(w_S.dtype)
    mean = torch.where(mean > 1e-8, mean, torch.ones_like(mean))
    return weights_T / mean, mean


def _output(
    inp: CorrectionInput,
    weights_T: torch.Tensor,
    keep_T: torch.Tensor,
    extra: dict[str, torch.Tensor] | None = None,
) -> CorrectionOutput:
    mask_T = inp.loss_mask_T
    keep_T = keep_T & mask_T
    weights_T = torch.where(keep_T, weights_T, 0.0).to(inp.trainer_logprobs_T.dtype).detach()
    metrics = {
        "is/weight_mean": masked_mean(weights_T, mask_T),
        "is/weight_max": masked_max(weights_T, mask_T),
        "is/masked_frac": masked_mean((mask_T & ~keep_T).float(), mask_T),
        "is/mismatch_kl": mismatch_kl(inp.rollout_logprobs_T, inp.trainer_logprobs_T, mask_T),
        **(extra or {}),
    }
    return CorrectionOutput(weights_T=weights_T, keep_T=keep_T, metrics=to_floats(metrics))


def combine(*outputs: CorrectionOutput) -> CorrectionOutput:
    """Apply several corrections at once: weights multiply, keep masks AND, metrics merge
    (later names win). E.g. version_gap to drop stale tokens, then tis on the rest."""
    if not outputs:
        raise ValueError("combine needs at least one CorrectionOutput")
    weights_T, keep_T, metrics = outputs[0].weights_T, outputs[0].keep_T, dict(outputs[0].metrics)
    for out in outputs[1:]:
        weights_T = weights_T * out.weights_T
        keep_T = keep_T & out.keep_T
        metrics.update(out.metrics)
    return CorrectionOutput(
        weights_T=torch.where(keep_T, weights_T, 0.0), keep_T=keep_T, metrics=metrics
    )


@CORRECTIONS.register("none", CorrectionConfig)
def none(inp: CorrectionInput, cfg: CorrectionConfig) -> CorrectionOutput:
    """No correction: weight 1 on every counted token (mismatch is still measured)."""
    ones_T = torch.ones_like(inp.trainer_logprobs_T)
    return _output(inp, ones_T, inp.loss_mask_T.clone())


@CORRECTIONS.register("tis", TISConfig)
def tis(inp: CorrectionInput, cfg: TISConfig) -> CorrectionOutput:
    """Truncated IS (Yao et al. 2025, "Your efficient RL framework secretly brings you
    off-policy RL training"): weight = clamp(ratio, low, cap); every counted token is kept.
    'is/clipped_frac' counts the tokens clamped on either side."""
    ratio_T = torch.exp(log_ratio_at_level(inp, cfg.level))
    clipped_T = (ratio_T > cfg.cap) | (ratio_T < cfg.low)
    extra = {"is/clipped_frac": masked_mean(clipped_T.float(), inp.loss_mask_T)}
    weights_T = ratio_T.clamp(cfg.low, cfg.cap)
    if cfg.batch_normalize:
        weights_T, extra["is/batch_norm_factor"] = normalize_weights(inp, weights_T, cfg.level)
    return _output(inp, weights_T, inp.loss_mask_T.clone(), extra)


def _masked_is(inp: CorrectionInput, cfg: MISConfig) -> CorrectionOutput:
    ratio_T = torch.exp(log_ratio_at_level(inp, cfg.level))
    keep_T = (ratio_T >= cfg.low) & (ratio_T <= cfg.high)
    weights_T = ratio_T if cfg.reweight else torch.ones_like(ratio_T)
    extra: dict[str, torch.Tensor] = {}
    if cfg.batch_normalize:
        kept_T = torch.where(keep_T, weights_T, 0.0)
        weights_T, extra["is/batch_norm_factor"] = normalize_weights(inp, kept_T, cfg.level)
    return _output(inp, weights_T, keep_T, extra)


@CORRECTIONS.register("mis", MISConfig)
def mis(inp: CorrectionInput, cfg: MISConfig) -> CorrectionOutput:
    """Masked IS: keep tokens whose ratio is in [low, high] (inclusive), weight them by the
    ratio (or 1 without reweight), drop the others."""
    return _masked_is(inp, cfg)


@CORRECTIONS.register("icepop", IcePopConfig)
def icepop(inp: CorrectionInput, cfg: IcePopConfig) -> CorrectionOutput:
    """IcePop: masked IS with IcePop's defaults (token level, band [0.5, 5])."""
    return _masked_is(inp, cfg)


@CORRECTIONS.register("topr", TOPRConfig)
def topr(inp: CorrectionInput, cfg: TOPRConfig) -> CorrectionOutput:
    """Tapered Off-Policy REINFORCE: weight 1 where the advantage is >= 0 (SFT-like, no IS),
    min(ratio, 1) where it is negative (truncated IS, ratios are >= 0 so this is the
    paper's clip to [0, 1]). The paper splits by the sign of the reward of the trajectory
    (its baseline shifts that split); here the sign of the token's advantage decides."""
    if inp.advantages_T is None:
        raise ValueError(
            "correction=topr needs CorrectionInput.advantages_T (its weight depends on the "
            "advantage's sign); pass the per-token advantages"
        )
    ratio_T = torch.exp(log_ratio_at_level(inp, cfg.level))
    negative_T = inp.advantages_T < 0
    weights_T = torch.where(negative_T, ratio_T.clamp(max=1.0), 1.0)
    mask_T = inp.loss_mask_T
    extra = {
        "is/negative_frac": masked_mean(negative_T.float(), mask_T),
        "is/clipped_frac": masked_mean((negative_T & (ratio_T > 1.0)).float(), mask_T),
    }
    return _output(inp, weights_T, mask_T.clone(), extra)


@CORRECTIONS.register("version_gap", VersionGapConfig)
def version_gap(inp: CorrectionInput, cfg: VersionGapConfig) -> CorrectionOutput:
    """Drop tokens with current_version - version > max_gap (weight 1 on the rest); at
    level 'sequence' a sequence with one such token is dropped whole."""
    if inp.versions_T is None or inp.current_version is None:
        raise ValueError(
            "correction=version_gap needs CorrectionInput.versions_T and current_version "
            "(the policy version of each token and of the trainer)"
        )
    mask_T = inp.loss_mask_T
    gap_T = inp.current_version - inp.versions_T
    stale_T = mask_T & (gap_T > cfg.max_gap)
    if cfg.level == "sequence":
        stale_S = segment_sum(stale_T.float(), inp.seq_ids_T, inp.num_seqs) > 0
        stale_T = stale_S[inp.seq_ids_T]
    gap_f_T = gap_T.to(torch.float32)
    extra = {"is/gap_mean": masked_mean(gap_f_T, mask_T), "is/gap_max": masked_max(gap_f_T, mask_T)}
    return _output(inp, torch.ones_like(inp.trainer_logprobs_T), ~stale_T, extra)


@CORRECTIONS.register("opsm", OPSMConfig)
def opsm(inp: CorrectionInput, cfg: OPSMConfig) -> CorrectionOutput:
    """Off-policy sequence masking (DeepSeek-V3.2, arXiv 2512.02556, §3.1):

        keep_t = not (A_t < 0 and 1/|o_i| Σ_{s in o_i} log(μ_s / π_s) > δ),   t in o_i

    with μ = rollout_logprobs_T (the sampler) and π = trainer_logprobs_T, the mean over
    the sequence's counted tokens; weight 1 on kept tokens, 0 on dropped ones. The paper
    takes π as the policy being trained; here it is the trainer's logprobs the correction
    is given (the pre-update policy), once per step. A sequence that drifted far from the
    trainer and would be pushed down is not learned from; positive ones always are. With a
    per-sequence advantage (GRPO) whole sequences are dropped, as the paper; a token's own
    advantage decides, as slime's compute_opsm_mask.
    """
    if inp.advantages_T is None:
        raise ValueError(
            "correction=opsm needs CorrectionInput.advantages_T (it drops only sequences "
            "with a negative advantage); pass the per-token advantages"
        )
    mask_T, seq_T, S = inp.loss_mask_T, inp.seq_ids_T, inp.num_seqs
    log_mu_over_pi_T = (inp.rollout_logprobs_T - inp.trainer_logprobs_T).detach()
    seq_kl_S = segment_mean(log_mu_over_pi_T, mask_T, seq_T, S)
    negative_T = inp.advantages_T < 0
    drop_T = negative_T & (seq_kl_S[seq_T] > cfg.delta)
    counted_S = segment_count(mask_T, seq_T, S) > 0
    extra = {
        "is/negative_frac": masked_mean(negative_T.float(), mask_T),
        "is/seq_kl_mean": seq_kl_S.sum() / counted_S.sum().clamp(min=1).to(seq_kl_S.dtype),
    }
    return _output(inp, torch.ones_like(inp.trainer_logprobs_T), mask_T & ~drop_T, extra)
