"""The numbers of one held-out set's evaluation, from its scored completions.

    eval/<set>/pass@1            greedy: fraction of prompts whose greedy completion
                                 passes; without greedy: the unbiased estimate from samples
    eval/<set>/pass@<k>          unbiased pass@k from the n samples (moerl.algo.pass_at_k)
    eval/<set>/pass@1_sampled    the sampled pass@1 when greedy took the name pass@1
    eval/<set>/reward_mean       mean reward of every completion of the set
    eval/<set>/response_len_mean mean response tokens of every completion
    eval/<set>/prompts           prompts evaluated

A completion passes when its reward >= threshold. The caller adds the version and step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from moerl.algo.pass_at_k import mean_pass_at_k
from moerl.common.trajectory import Trajectory


@dataclass
class PromptResult:
    """The scored completions (``reward`` set) of one held-out prompt."""

    greedy: Trajectory | None = None
    """The greedy completion, when eval.greedy."""
    samples: list[Trajectory] = field(default_factory=list)
    """The n sampled completions."""


def _passes(traj: Trajectory, threshold: float) -> bool:
    if traj.reward is None:
        raise ValueError(f"{traj.name()} was not scored; eval metrics need rewards")
    return float(traj.reward) >= threshold


def set_metrics(
    name: str, results: Sequence[PromptResult], ks: Sequence[int], threshold: float
) -> dict[str, float]:
    """The metrics of set ``name`` (keys ``eval/<name>/...``) over its prompts' results."""
    if not results:
        raise ValueError(f"eval set {name!r} has no results")
    out: dict[str, float] = {}
    greedy = [r.greedy for r in results if r.greedy is not None]
    if greedy and len(greedy) != len(results):
        raise ValueError(f"eval set {name!r}: some prompts lack their greedy completion")
    if greedy:
        out["pass@1"] = sum(_passes(t, threshold) for t in greedy) / len(greedy)
    n = [len(r.samples) for r in results]
    if any(n):
        c = [sum(_passes(t, threshold) for t in r.samples) for r in results]
        for k in ks:
            key = "pass@1_sampled" if (k == 1 and greedy) else f"pass@{k}"
            out[key] = mean_pass_at_k(n, c, int(k))
    every = [*greedy, *(t for r in results for t in r.samples)]
    out["reward_mean"] = sum(float(t.reward or 0.0) for t in every) / len(every)
    out["response_len_mean"] = sum(t.response_len for t in every) / len(every)
    out["prompts"] = float(len(results))
    return {f"eval/{name}/{key}": float(value) for key, value in out.items()}
