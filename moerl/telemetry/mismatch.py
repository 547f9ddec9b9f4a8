"""Train/inference mismatch: k3 KL, |Δ logprob|, staleness, and its decomposition.

The decomposition scores one batch several ways and attributes the k3 KL between the
rollout's and the trainer's logprobs to its causes (docs/architecture.md, "Keep Routing
and sampling-mask replay"):

- routing: what switching Keep Routing off adds (trainer routes freshly),
- sampling mask: what comparing full-vocabulary logprobs instead of kept-set ones adds,
- staleness: the part carried by tokens sampled by an older policy version,
- numerics: the rest (fresh tokens, replay and mask on: kernels, dtypes, batching).
"""

# T response tokens

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def k3_per_token(trainer_T: np.ndarray, rollout_T: np.ndarray) -> np.ndarray:
    """Schulman's k3 estimator of KL(rollout ‖ trainer) per token: r − 1 − log r with
    r = p_trainer / p_rollout, computed without cancellation."""
    d = np.asarray(trainer_T, np.float64) - np.asarray(rollout_T, np.float64)
    return np.expm1(d) - d


def k3(trainer_T: np.ndarray, rollout_T: np.ndarray) -> float:
    return float(k3_per_token(trainer_T, rollout_T).mean()) if len(trainer_T) else 0.0


def staleness_histogram(versions_T: np.ndarray, current_version: int) -> dict[int, int]:
    """Token counts by version gap (current − sampling version)."""
    gaps, counts = np.unique(current_version - np.asarray(versions_T, np.int64), return_counts=True)
    return {int(g): int(c) for g, c in zip(gaps, counts)}


@dataclass
class Decomposition:
    total: float  # k3 with replay and mask off (what an MoE trainer sees without them)
    routing: float
    sampling_mask: float
    staleness: float
    numerics: float

    def line(self) -> str:
        return (
            f"mismatch_total={self.total:.3e} routing={self.routing:.3e} "
            f"sampling_mask={self.sampling_mask:.3e} staleness={self.staleness:.3e} "
            f"numerics={self.numerics:.3e}"
        )


def decompose(
    *,
    replay_mask_T: np.ndarray,
    fresh_route_mask_T: np.ndarray,
    replay_full_vocab_T: np.ndarray,
    fresh_route_full_vocab_T: np.ndarray,
    rollout_sampling_T: np.ndarray,
    rollout_full_T: np.ndarray,
    stale_T: np.ndarray,
) -> Decomposition:
    """Trainer logprobs of the same tokens under the four settings → components.

    ``*_mask_T`` are kept-set logprobs (compared with the engine's sampling logprobs),
    ``*_full_vocab_T`` full-vocabulary ones (compared with its output logprobs);
    ``stale_T`` marks tokens sampled by an older policy version.
    """
    base_T = k3_per_token(replay_mask_T, rollout_sampling_T)
    base = float(base_T.mean())
    stale = np.asarray(stale_T, bool)
    return Decomposition(
        total=k3(fresh_route_full_vocab_T, rollout_full_T),
        routing=k3(fresh_route_mask_T, rollout_sampling_T) - base,
        sampling_mask=k3(replay_full_vocab_T, rollout_full_T) - base,
        staleness=float(base_T[stale].sum() / len(base_T)) if len(base_T) else 0.0,
        numerics=float(base_T[~stale].sum() / len(base_T)) if len(base_T) else 0.0,
    )
