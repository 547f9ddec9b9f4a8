"""Sampling parameters (SGLang's names) and the sampler that records its kept set.

For each position the sampler applies temperature, then top-k, top-p and min-p,
samples from the renormalised kept set, and reports

- ``logprob``: the sampled token's log-probability under the full vocabulary at
  the sampling temperature (temperature 0, i.e. greedy, reports temperature 1),
- ``mask``: the kept token ids ordered by probability, highest first (SGLang's
  order), i.e. the sampling support, and
- ``sampling_logprob``: the sampled token's log-probability renormalised over the
  kept set (0 for greedy, whose kept set is the one chosen token).
"""

# B batch rows, V vocabulary

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

GREEDY_EPS = 1e-5


class UnknownFieldError(ValueError):
    """An unknown key: SGLang's contract gate answers these with ``{"error": "..."}``."""


@dataclass
class SamplingParams:
    """The subset of SGLang's ``sampling_params`` the embedded engine serves."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1

    @classmethod
    def from_request(cls, raw: dict | None) -> SamplingParams:
        """Parse a request's ``sampling_params``; ValueError names unknown or bad keys."""
        raw = dict(raw or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise UnknownFieldError(
                f"unknown field `{unknown[0]}` in sampling_params, expected one of "
                + ", ".join(f"`{k}`" for k in sorted(known))
            )
        if raw.get("stop_token_ids") is None:
            raw.pop("stop_token_ids", None)
        params = cls(**raw)
        params.validate()
        return params

    def validate(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r} must be an integer >= 0")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k} must be -1 (all) or >= 1")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p={self.min_p} must be in [0, 1]")
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n={self.n!r} must be an integer >= 1")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS or self.top_k == 1


@dataclass
class Sampled:
    token: int
    logprob: float
    mask: list[int]
    sampling_logprob: float
    support_logprobs: list[float]


def kept_set(logits_V: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Boolean [V] mask of the tokens the sampler may choose (the sampling support)."""
    if params.greedy:
        keep = torch.zeros_like(logits_V, dtype=torch.bool)
        keep[int(torch.argmax(logits_V))] = True
        return keep
    probs = torch.softmax(logits_V.float() / params.temperature, dim=-1)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if params.top_k > 0 and params.top_k < probs.numel():
        kth = torch.topk(probs, params.top_k).values[-1]
        keep &= probs >= kth
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_p, dim=0) - sorted_p  # mass strictly above each token
        keep_sorted = before < params.top_p
        keep_sorted[0] = True
        nucleus = torch.zeros_like(keep)
        nucleus[order[keep_sorted]] = True
        keep &= nucleus
    if params.min_p > 0.0:
        keep &= probs >= params.min_p * probs.max()
    return keep


def sample(logits_V: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> Sampled:
    """Sample one token from fp32 logits [V] and record logprob, kept set and the
    renormalised logprob (see the module docstring)."""
    logits_V = logits_V.float()
    temperature = (
        params.temperature if not params.greedy or params.temperature >= GREEDY_EPS else 1.0
    )
    logprobs_V = torch.log_softmax(logits_V / max(temperature, GREEDY_EPS), dim=-1)
    keep = kept_set(logits_V, params)
    kept_ids = torch.nonzero(keep).flatten()
    kept_ids = kept_ids[torch.argsort(logprobs_V[kept_ids], descending=True, stable=True)]
    kept_logprobs = torch.log_softmax(logprobs_V[kept_ids], dim=-1)
    if kept_ids.numel() == 1:
        choice = 0
    else:
        choice = int(torch.multinomial(kept_logprobs.exp(), 1, generator=generator))
    token = int(kept_ids[choice])
    return Sampled(
        token=token,
        logprob=float(logprobs_V[token]),
        mask=kept_ids.tolist(),
        sampling_logprob=float(kept_logprobs[choice]),
        support_logprobs=kept_logprobs.tolist(),
    )
