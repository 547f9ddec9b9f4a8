"""The step's off-policy inputs, computed once over the whole rollout batch before the
update: the trainer's old-policy logprobs π_old and the IS correction's weights.

# T response tokens of the batch, S sequences

A correction depends only on π_old and the behaviour logprobs μ, both known before the
first optimizer step of the batch, so it sees every token of the batch at once (a
batch-normalised weight or a statistic across a group is then what the paper means),
whatever the micro-batch size and however many minibatches the batch is split into. The
mismatch metrics (k3, |Δ logprob|, staleness) come from the same forward.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from moerl.algo.correction import CorrectionInput, CorrectionOutput
from moerl.common.trajectory import Trajectory
from moerl.trainer.batch import Advantage, behaviour_logprobs, token_advantages


@dataclass
class OffPolicyBatch:
    """Per trajectory (one [R] array each), for rl_train_step."""

    old_logprobs: list[np.ndarray] | None = None
    """π_old of each response token; None when the step needs none (bypass, no correction)."""
    is_weights: list[np.ndarray] | None = None
    """The correction's weight of each response token (0 = dropped); None = no correction."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The correction's metrics and the batch's mismatch metrics."""

    def select(self, indices: list[int]) -> OffPolicyBatch:
        """The part of a minibatch made of the trajectories at ``indices``."""

        def pick(arrays: list[np.ndarray] | None) -> list[np.ndarray] | None:
            return None if arrays is None else [arrays[i] for i in indices]

        return OffPolicyBatch(pick(self.old_logprobs), pick(self.is_weights), dict(self.metrics))


def mismatch_metrics(
    trainer_T: torch.Tensor,
    behaviour_T: torch.Tensor,
    versions_T: torch.Tensor,
    seq_ids_T: torch.Tensor,
    num_seqs: int,
    current_version: int,
) -> dict[str, torch.Tensor]:
    """Trainer-vs-behaviour mismatch of the tokens: k3, |Δ logprob|, staleness, and the
    log ratio of sequences sampled entirely by the current version (with replay and mask
    in fp32 that is numerics only: the on-policy anchor). A maximum over no token is
    -inf (the key is dropped once reduced)."""
    d_T = trainer_T.detach().double() - behaviour_T.double()
    gap_T = (current_version - versions_T).double()
    stale_S = torch.zeros(num_seqs, dtype=torch.float64, device=seq_ids_T.device).index_add_(
        0, seq_ids_T, (gap_T > 0).double()
    )
    onpolicy_T = stale_S[seq_ids_T] == 0
    onpolicy_d_T = d_T[onpolicy_T].abs()
    return {
        "mismatch/k3": (torch.expm1(d_T) - d_T).mean(),
        "mismatch/log_ratio_abs_max": d_T.abs().max(),
        # the same maximum under the name true on-policy runs read it by: max |log π − log μ|
        "mismatch/abs_diff_max": d_T.abs().max(),
        "mismatch/mean_abs_dlogp": d_T.abs().mean(),
        "mismatch/onpolicy_log_ratio_abs_max": (
            onpolicy_d_T.max() if onpolicy_d_T.numel() else torch.tensor(-float("inf"))
        ),
        "mismatch/onpolicy_frac": onpolicy_T.double().mean(),
        "staleness/mean": gap_T.mean(),
        "staleness/stale_frac": (gap_T > 0).double().mean(),
    }


def turn_staleness(trajs: list[Trajectory], current_version: int) -> dict[str, float]:
    """Staleness per turn of the batch's episodes: ``episode/staleness_turn_K`` is the mean
    version gap (current - the version that sampled it) of the K-th actions' tokens, for
    K < 4, and ``episode/staleness_turn_last`` that of each episode's last action; {}
    without episodes."""
    gaps: dict[str, list[float]] = {}
    for t in trajs:
        actions = t.actions
        for k, seg in enumerate(actions):
            gap = float(current_version - np.mean(t.versions[seg.start : seg.end]))
            if k < 4:
                gaps.setdefault(f"episode/staleness_turn_{k}", []).append(gap)
            if k == len(actions) - 1:
                gaps.setdefault("episode/staleness_turn_last", []).append(gap)
    return {k: float(np.mean(v)) for k, v in gaps.items()}


def finite_metrics(metrics: Mapping[str, torch.Tensor | float]) -> dict[str, float]:
    """Floats, without the maxima that saw no token (-inf)."""
    out = {k: float(v) for k, v in metrics.items()}
    return {k: v for k, v in out.items() if v != -float("inf")}


def check_weights(weights_T: torch.Tensor) -> None:
    """Refuse a correction's non-finite weights before they reach a gradient."""
    if not bool(torch.isfinite(weights_T).all()):
        raise ValueError(
            "the IS correction returned non-finite weights: check the rollout logprobs "
            "and the trainer's logprobs for NaN/inf"
        )


def prepare(
    trajs: list[Trajectory],
    advantages: list[Advantage],
    *,
    old_logprobs: list[np.ndarray] | None,
    correction_fn: Callable[[CorrectionInput], CorrectionOutput] | None,
    use_mask: bool,
    current_version: int,
) -> OffPolicyBatch:
    """Run the correction once over every trained response token of ``trajs`` (π_old
    against μ; an episode's spliced observation tokens take no part and get weight 1)
    and measure the mismatch. ``old_logprobs`` (π_old per trajectory) is needed by any
    correction; ``correction_fn`` None = no correction (weights None)."""
    if correction_fn is not None and old_logprobs is None:
        raise ValueError("an IS correction needs the trainer's old-policy logprobs of the batch")
    if old_logprobs is None:
        return OffPolicyBatch()
    lengths = [t.response_len for t in trajs]
    for t, old, n in zip(trajs, old_logprobs, lengths):
        if np.shape(old) != (n,):
            raise ValueError(
                f"old-policy logprobs of trajectory {t.group_id}/{t.index} have shape "
                f"{np.shape(old)}; expected ({n},)"
            )
    trained_A = torch.from_numpy(np.concatenate([t.trained for t in trajs]))
    seq_T = torch.repeat_interleave(torch.arange(len(trajs)), torch.tensor(lengths))[trained_A]
    old_T = torch.from_numpy(np.concatenate(old_logprobs).astype(np.float64))[trained_A]
    mu_T = torch.from_numpy(np.concatenate([behaviour_logprobs(t, use_mask) for t in trajs]))
    mu_T = mu_T.double()[trained_A]
    versions_T = torch.from_numpy(np.concatenate([np.asarray(t.versions) for t in trajs]))
    versions_T = versions_T.long()[trained_A]
    metrics = mismatch_metrics(old_T, mu_T, versions_T, seq_T, len(trajs), current_version)
    result = OffPolicyBatch(old_logprobs=[np.asarray(o, np.float32) for o in old_logprobs])
    if correction_fn is not None:
        adv_A = np.concatenate([token_advantages(a, t) for a, t in zip(advantages, trajs)])
        corr = correction_fn(
            CorrectionInput(
                trainer_logprobs_T=old_T, rollout_logprobs_T=mu_T,
                loss_mask_T=torch.ones(len(old_T), dtype=torch.bool), seq_ids_T=seq_T,
                num_seqs=len(trajs), versions_T=versions_T, current_version=current_version,
                advantages_T=torch.from_numpy(adv_A).double()[trained_A],
            )
        )  # fmt: skip
        check_weights(corr.weights_T)
        weights_A = torch.ones(len(trained_A), dtype=torch.float32)
        weights_A[trained_A] = corr.weights_T.detach().to(torch.float32)
        result.is_weights = list(np.split(weights_A.numpy(), np.cumsum(lengths)[:-1]))
        metrics.update({k: torch.tensor(v) for k, v in corr.metrics.items()})
    result.metrics = finite_metrics(metrics)
    return result
