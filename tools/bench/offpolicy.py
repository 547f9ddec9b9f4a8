"""The off-policy objective on the tiny recipe: bypass, recompute + TIS, and the former
composition, at several staleness bounds, side by side.

    python tools/bench/offpolicy.py [--steps 40] [--staleness 0 2 4] [--quick] [--out DIR]

Variants (every other setting shared, same seed):

    bypass     algo.old_policy=rollout correction=none: PPO's ratio against the engine's
               logprobs μ, no reweighting (no extra forward)
    recompute  algo.old_policy=recompute correction=tis: PPO's ratio against the
               trainer's own π_old, each token weighted by min(π_old/μ, C) (Yao et al. 2025)
    former     the composition moerl used before algo.old_policy existed: the ratio against
               μ *and* the TIS weight min(π_θ/μ, C) on top, so each token carries r·min(r, C).
               Kept only here, as the custom loss ``former_ppo_tis``; validation refuses
               writing it with the built-ins.

Per (staleness, variant) it prints one line

    staleness=… variant=… reward_last5=… abs_log_ratio=… is_weight_max=… clipped_frac=… step_s=…

reward_last5: the mean reward of the last five steps; abs_log_ratio: the mean over steps
of mismatch/mean_abs_dlogp (|log π_old − log μ| per token); is_weight_max: the mean over
steps of the largest IS weight (1 for bypass); clipped_frac: the share of truncated
weights. --out DIR writes DIR/result.json (with each run's per-step rewards: run_all's
report draws reward vs step from it, one panel per staleness bound). Differences on the tiny model are small where staleness is 0 (μ
equals π_old but for numerics) and grow with the bound.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the former loss's _target_ and async_vs_sync's runner
    sys.path.insert(0, str(HERE))

RECIPE = "deepseek_moe"
VARIANTS: dict[str, list[str]] = {
    "bypass": ["algo.old_policy=rollout", "correction=none"],
    "recompute": ["algo.old_policy=recompute", "correction=tis"],
    "former": [
        "algo.old_policy=rollout",
        "correction=none",
        "algo/loss=custom",
        "algo.loss._target_=offpolicy.former_ppo_tis",
    ],
}


def former_ppo_tis(inp: Any, cap: float = 2.0, eps: float = 0.2) -> Any:
    """moerl's former composition (for this comparison only): ppo_clip with r = π_θ/μ,
    each token also weighted by sg(min(r, cap)). Under algo.old_policy=rollout the loss's
    old_logprobs_T is μ."""
    import torch

    from moerl.algo.config import PPOClipConfig
    from moerl.algo.losses import ppo_clip

    r_T = torch.exp(inp.logprobs_T.detach() - inp.old_logprobs_T)
    out = ppo_clip(
        replace(inp, is_weights_T=r_T.clamp(max=cap)), PPOClipConfig(eps_low=eps, eps_high=eps)
    )
    mask_T = inp.loss_mask_T
    out.metrics["is/weight_max"] = float(r_T.clamp(max=cap)[mask_T].max())
    out.metrics["is/clipped_frac"] = float((r_T[mask_T] > cap).float().mean())
    return out


def overrides(args: argparse.Namespace, staleness: int, variant: str) -> list[str]:
    groups = args.batch // args.group_size
    return [
        f"+recipe={RECIPE}",
        f"trainer.train_iters={args.steps}",
        f"trainer.global_batch_size={args.batch}",
        f"trainer.seed={args.seed}",
        f"rollout.group_size={args.group_size}",
        f"rollout.max_inflight_groups={(staleness + 1) * groups}",
        f"staleness.max_staleness={staleness}",
        f"engine.threads={args.engine_threads}",
        "telemetry.flip_every=0",
        "telemetry.progress_interval_s=1000",
        *VARIANTS[variant],
    ]


def summarize(metrics: list[dict[str, Any]]) -> dict[str, Any]:
    def mean(key: str, default: float) -> float:
        return float(np.mean([m.get(key, default) for m in metrics]))

    rewards = [float(m["reward_mean"]) for m in metrics]
    return {
        "reward_last5": float(np.mean(rewards[-5:])),
        "abs_log_ratio": mean("mismatch/mean_abs_dlogp", float("nan")),
        "is_weight_max": mean("is/weight_max", 1.0),
        "clipped_frac": mean("is/clipped_frac", 0.0),
        "step_s": mean("step_s", float("nan")),
        "reward": rewards,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from async_vs_sync import run_once

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 2, 4])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--engine-threads", type=int, default=1)
    parser.add_argument("--trainer-threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--quick", action="store_true", help="12 steps, batch 16")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.batch = 12, 16
    root = args.out / "runs" if args.out else Path(tempfile.mkdtemp(prefix="moerl-offpolicy-"))
    if args.out is not None and root.exists():
        shutil.rmtree(root)
    results: dict[str, Any] = {}
    for staleness in args.staleness:
        for variant in args.variants:
            run_dir = root / f"s{staleness}-{variant}"
            metrics = run_once(overrides(args, staleness, variant), run_dir, args.trainer_threads)
            summary = summarize(metrics)
            results[f"{staleness}/{variant}"] = summary
            line = " ".join(f"{k}={v:.4g}" for k, v in summary.items() if isinstance(v, float))
            print(f"staleness={staleness} variant={variant} {line}", flush=True)
    results["steps"] = args.steps
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "result.json").write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
