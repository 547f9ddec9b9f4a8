"""Advantage estimators: one scalar reward per sequence → one advantage per sequence.

# S sequences (sampled completions), G groups (completions of the same prompt)

All estimators here are outcome-level: the advantage of a sequence is broadcast to its
tokens by the caller (`advantages_S[seq_ids_T]`). Group ids may be any integers; they are
only compared for equality. Standard deviations are Bessel-corrected (as torch.std, and
as GRPO's reference code) and defined as 0 for a single sample, so a group of one gets
advantage 0 from every group-baseline estimator rather than 0/0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from moerl.algo.config import (
    DrGRPOConfig,
    GRPOConfig,
    ReinforcePPBaselineConfig,
    ReinforcePPConfig,
    RLOOConfig,
)
from moerl.algo.reduce import segment_sum, to_floats
from moerl.common.registry import Registry


@dataclass
class AdvantageInput:
    """Rewards of one batch of sequences and the group (prompt) each was sampled for."""

    rewards_S: torch.Tensor
    """float [S]: scalar reward of each sequence."""
    group_ids_S: torch.Tensor
    """int64 [S]: group of each sequence; sequences with equal ids share a baseline."""

    def __post_init__(self) -> None:
        if self.rewards_S.dim() != 1 or self.rewards_S.shape != self.group_ids_S.shape:
            raise ValueError(
                f"AdvantageInput: rewards_S {tuple(self.rewards_S.shape)} and group_ids_S "
                f"{tuple(self.group_ids_S.shape)} must be 1-D of the same length"
            )
        if not self.rewards_S.is_floating_point():
            self.rewards_S = self.rewards_S.to(torch.float32)


@dataclass
class AdvantageOutput:
    """One advantage per sequence, and scalars worth logging."""

    advantages_S: torch.Tensor
    """float [S]: the advantage of each sequence (detached)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """reward/advantage statistics, e.g. 'adv/zero_std_group_frac'."""


ADVANTAGES: Registry[AdvantageInput, AdvantageOutput] = Registry("advantage", "algo.advantage")


def build_advantage(spec: Any) -> Callable[[AdvantageInput], AdvantageOutput]:
    """Config (name, options dataclass, mapping or `_target_`) → `fn(AdvantageInput)`."""
    return ADVANTAGES.build(spec)


@dataclass
class _Groups:
    """Per-group reward statistics; the `_S` ones are broadcast back to sequences."""

    count_S: torch.Tensor  # size of the sequence's group
    mean_S: torch.Tensor  # mean reward of the group
    std_S: torch.Tensor  # Bessel-corrected std of the group; 0 for a group of one
    sum_S: torch.Tensor  # reward sum of the group
    std_G: torch.Tensor  # one std per group, for the metrics


def _groups(rewards_S: torch.Tensor, group_ids_S: torch.Tensor) -> _Groups:
    uniq_G, index_S = torch.unique(group_ids_S, return_inverse=True)
    num_groups = uniq_G.numel()
    count_G = segment_sum(torch.ones_like(rewards_S), index_S, num_groups)
    sum_G = segment_sum(rewards_S, index_S, num_groups)
    mean_G = sum_G / count_G.clamp(min=1)
    sq_dev_G = segment_sum((rewards_S - mean_G[index_S]) ** 2, index_S, num_groups)
    std_G = torch.where(count_G > 1, sq_dev_G / (count_G - 1).clamp(min=1), 0.0).sqrt()
    # A group of equal rewards must give exactly 0, not rounding noise / (tiny std + eps).
    big = torch.full_like(sum_G, float("inf"))
    min_G = big.scatter_reduce(0, index_S, rewards_S, "amin")
    max_G = (-big).scatter_reduce(0, index_S, rewards_S, "amax")
    equal_G = min_G == max_G
    mean_G = torch.where(equal_G, min_G, mean_G)
    std_G = torch.where(equal_G, 0.0, std_G)
    return _Groups(count_G[index_S], mean_G[index_S], std_G[index_S], sum_G[index_S], std_G)


def _batch_centre(values_S: torch.Tensor) -> torch.Tensor:
    """values - their mean, exactly 0 when all are equal."""
    equal = values_S.max() == values_S.min()
    return torch.where(equal, 0.0, values_S - values_S.mean())


def _batch_std(values_S: torch.Tensor) -> torch.Tensor:
    if values_S.numel() < 2:
        return values_S.new_zeros(())
    return values_S.std()


def _output(inp: AdvantageInput, groups: _Groups, advantages_S: torch.Tensor) -> AdvantageOutput:
    r, a = inp.rewards_S, advantages_S
    if r.numel() == 0:
        return AdvantageOutput(advantages_S=a.detach(), metrics={})
    metrics = to_floats(
        {
            "reward/mean": r.mean(),
            "reward/std": _batch_std(r),
            "adv/mean": a.mean(),
            "adv/std": _batch_std(a),
            "adv/abs_max": a.abs().max(),
            # Groups whose members all got the same reward: no signal under a group baseline.
            "adv/zero_std_group_frac": (groups.std_G == 0).to(r.dtype).mean(),
        }
    )
    return AdvantageOutput(advantages_S=a.detach(), metrics=metrics)


@ADVANTAGES.register("grpo", GRPOConfig)
def grpo(inp: AdvantageInput, cfg: GRPOConfig) -> AdvantageOutput:
    """(r - group mean) / (group std + eps), or r - group mean without std_normalize."""
    g = _groups(inp.rewards_S, inp.group_ids_S)
    adv_S = inp.rewards_S - g.mean_S
    if cfg.std_normalize:
        adv_S = adv_S / (g.std_S + cfg.eps)
    return _output(inp, g, adv_S)


@ADVANTAGES.register("dr_grpo", DrGRPOConfig)
def dr_grpo(inp: AdvantageInput, cfg: DrGRPOConfig) -> AdvantageOutput:
    """r - group mean: Dr. GRPO drops the std division, which favours easy/hard prompts."""
    g = _groups(inp.rewards_S, inp.group_ids_S)
    return _output(inp, g, inp.rewards_S - g.mean_S)


@ADVANTAGES.register("rloo", RLOOConfig)
def rloo(inp: AdvantageInput, cfg: RLOOConfig) -> AdvantageOutput:
    """r_i - mean_{j != i} r_j over i's group; a group of one has no other member → 0."""
    g = _groups(inp.rewards_S, inp.group_ids_S)
    others_S = (g.count_S - 1).clamp(min=1)
    baseline_S = (g.sum_S - inp.rewards_S) / others_S
    # std 0 marks a group of one or of equal rewards (exactly, see _groups): advantage 0.
    adv_S = torch.where(g.std_S > 0, inp.rewards_S - baseline_S, 0.0)
    return _output(inp, g, adv_S)


@ADVANTAGES.register("reinforce_pp", ReinforcePPConfig)
def reinforce_pp(inp: AdvantageInput, cfg: ReinforcePPConfig) -> AdvantageOutput:
    """(r - batch mean) / (batch std + eps): REINFORCE++'s global normalisation, no groups.

    OpenRLHF normalises over tokens (longer sequences weigh more); here every sequence
    counts once.
    """
    r = inp.rewards_S
    g = _groups(r, inp.group_ids_S)
    if r.numel() == 0:
        return _output(inp, g, r.clone())
    return _output(inp, g, _batch_centre(r) / (_batch_std(r) + cfg.eps))


@ADVANTAGES.register("reinforce_pp_baseline", ReinforcePPBaselineConfig)
def reinforce_pp_baseline(inp: AdvantageInput, cfg: ReinforcePPBaselineConfig) -> AdvantageOutput:
    """Subtract the group mean, then divide by the batch std (REINFORCE++-baseline).

    As for reinforce_pp, the std is over sequences, not tokens as in OpenRLHF.
    """
    g = _groups(inp.rewards_S, inp.group_ids_S)
    centred_S = inp.rewards_S - g.mean_S
    if centred_S.numel() == 0:
        return _output(inp, g, centred_S)
    # centred_S has batch mean 0 by construction (every group's does); subtracting the
    # computed mean again would only add rounding noise to the zero-advantage groups.
    adv_S = centred_S / (_batch_std(centred_S) + cfg.eps)
    return _output(inp, g, adv_S)
