"""KL estimators on sampled tokens (Schulman, "Approximating KL divergence", 2020).

# T tokens in the batch, S sequences

The tokens were sampled from the policy p; q is the other distribution (the reference
model for a KL penalty, the trainer for a mismatch metric). With log r = log q - log p,
each estimator's expectation under p is (about) KL(p || q):

    k1 = -log r                   unbiased, high variance, can be negative
    k2 = (log r)^2 / 2            biased, low variance, >= 0
    k3 = (r - 1) - log r          unbiased, low variance, >= 0 (GRPO's KL term)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moerl.algo.config import KL_KINDS, KLConfig
from moerl.algo.reduce import aggregate, check_tokens, masked_mean, to_floats
from moerl.common.checks import choice_error


def kl_penalty(logprobs_T: torch.Tensor, ref_logprobs_T: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || ref) for tokens sampled from the policy: [T].

    Differentiable in both arguments; the gradient of k3 through `logprobs_T` is that of
    GRPO's KL penalty.
    """
    log_r_T = ref_logprobs_T - logprobs_T
    if kind == "k1":
        return -log_r_T
    if kind == "k2":
        return 0.5 * log_r_T**2
    if kind == "k3":
        return torch.expm1(log_r_T) - log_r_T
    raise choice_error("KL estimator", kind, KL_KINDS)


@dataclass
class KLInput:
    """Current-policy and reference logprobs of the sampled tokens."""

    logprobs_T: torch.Tensor
    """float [T]: current policy logprob of each token (requires grad)."""
    ref_logprobs_T: torch.Tensor
    """float [T]: reference policy logprob of each token (detached)."""
    loss_mask_T: torch.Tensor
    """bool [T]: tokens that count (response tokens)."""
    seq_ids_T: torch.Tensor
    """int64 [T]: sequence of each token, 0..S-1."""
    num_seqs: int
    """S, the number of sequences (for the per-sequence aggregations)."""
    behaviour_logprobs_T: torch.Tensor | None = None
    """float [T], detached: logprobs of the policy that sampled the tokens; needed by
    KLConfig.importance_sampling."""

    def __post_init__(self) -> None:
        check_tokens(
            "KLInput",
            self.num_seqs,
            logprobs_T=self.logprobs_T,
            ref_logprobs_T=self.ref_logprobs_T,
            loss_mask_T=self.loss_mask_T,
            seq_ids_T=self.seq_ids_T,
            behaviour_logprobs_T=self.behaviour_logprobs_T,
        )


@dataclass
class KLOutput:
    """The weighted KL term and its logged value."""

    loss: torch.Tensor
    """Scalar: coef · aggregate(kl_T); add it to the policy loss."""
    metrics: dict[str, float] = field(default_factory=dict)
    """'kl/value' (the aggregated KL before coef), 'kl/coef', and with importance_sampling
    'kl/is_weight_mean'."""


def kl_term(inp: KLInput, cfg: KLConfig) -> KLOutput:
    """The KL penalty of `cfg`: coef · agg(kl_T), kl_T = kl_penalty(logprobs, ref, kind),
    clamped if set.

    With cfg.importance_sampling (DeepSeek-V3.2's unbiased KL estimate, arXiv 2512.02556
    §3.1), for tokens sampled by a behaviour policy μ rather than by π_θ:

        kl_T = (π_θ / μ) · k(π_θ, π_ref)

    the weight not detached, as the paper writes it: with k3 the gradient per token is then
    (π_θ / μ) · ∇log π_θ · log(π_θ / π_ref), an unbiased estimate of ∇KL(π_θ || π_ref).
    """
    kl_T = kl_penalty(inp.logprobs_T, inp.ref_logprobs_T, cfg.kind)
    metrics: dict[str, torch.Tensor] = {}
    if cfg.importance_sampling:
        if inp.behaviour_logprobs_T is None:
            raise ValueError(
                "algo.kl.importance_sampling=true needs KLInput.behaviour_logprobs_T (the "
                "logprobs of the policy that sampled the tokens); pass them or turn it off"
            )
        weight_T = torch.exp(inp.logprobs_T - inp.behaviour_logprobs_T.detach())
        kl_T = weight_T * kl_T
        metrics["kl/is_weight_mean"] = masked_mean(weight_T.detach(), inp.loss_mask_T)
    if cfg.clamp is not None:
        kl_T = kl_T.clamp(-cfg.clamp, cfg.clamp)
    value = aggregate(
        kl_T, inp.loss_mask_T, inp.seq_ids_T, inp.num_seqs, cfg.agg, norm_length=cfg.norm_length
    )
    metrics.update({"kl/value": value, "kl/coef": value.new_tensor(cfg.coef)})
    return KLOutput(loss=cfg.coef * value, metrics=to_floats(metrics))


def mismatch_kl(
    sampler_logprobs_T: torch.Tensor, other_logprobs_T: torch.Tensor, mask_T: torch.Tensor
) -> torch.Tensor:
    """Mean k3 estimate of KL(sampler || other) over the counted tokens (a metric, detached)."""
    with torch.no_grad():
        kl_T = kl_penalty(sampler_logprobs_T.detach(), other_logprobs_T.detach(), "k3")
        return masked_mean(kl_T, mask_T)
