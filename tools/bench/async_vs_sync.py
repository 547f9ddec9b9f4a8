"""Asynchronous vs synchronous RL on the same recipe, engines, steps and seed, side by side.

    python tools/bench/async_vs_sync.py [--steps 12] [--staleness 2] [--repeats 1]
                                        [--quick] [--out DIR]

Runs the recipe twice in one invocation: synchronously (staleness.max_staleness=0: each
step's groups are generated with the current weights while the trainer waits) and
asynchronously (max_staleness=K: generation runs up to K versions ahead of the trainer).
Both runs share every other setting, including a long-tailed response-length workload
(rollout.length_distribution=lognormal: p90 >= 5x the median, exact lengths whatever the
random model samples), the engine count and threads, and the trainer's thread count.
With --repeats N the two alternate N times and medians are reported, so other work on
the machine (each run records the load average before it) hits both alike.

Prints the settings and one line

    sync_s=… async_s=… speedup=… trainer_idle_sync=… trainer_idle_async=… len_p50=…
    len_p90=… token_speedup=…

sync_s / async_s: the training loop's wall time (metrics.jsonl `time_s` of the last step:
from the loop's start, after the engines are up and the weights connected, to the end of
the last step, so process and engine start-up are excluded; the first batch's generation
is included in both). trainer_idle_*: the trainer's time waiting for a batch over the
loop's time. len_p50 / len_p90: percentiles of the lengths drawn for the prompts the sync
run trains on. token_speedup: the ratio of trained response tokens per second; it differs
from speedup because the async run trains first on the groups that finish first (the
shorter ones) and leaves the slowest in flight at the end. Target on a 2-core machine (one
core for the engine, one for the trainer): speedup >= 1.8 and trainer_idle_async <= 0.2.
--out DIR keeps the run directories (DIR/runs), writes DIR/result.json and the timeline
plots DIR/timeline_{sync,async}.png. The result's ``per_step`` holds, for the first
repeat of each run, per-step ``time_s`` and ``reward_mean`` and ``staleness_tokens``
(tokens per version gap, summed over the steps).

The runs call moerl.launch's rank entry in-process (one spawned trainer process per rank)
rather than `python -m moerl.launch`, so the trainer's torch thread count can be set
(--trainer-threads; the launcher otherwise gives each rank all cores / world size).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

RECIPE = "deepseek_moe"


def workload(args: argparse.Namespace) -> list[str]:
    """Overrides shared by both runs (everything but the staleness bound)."""
    return [
        f"+recipe={args.recipe}",
        f"trainer.train_iters={args.steps}",
        f"trainer.global_batch_size={args.batch}",
        f"trainer.seed={args.seed}",
        f"rollout.group_size={args.group_size}",
        # room for max(staleness)+1 steps of groups in flight, in both runs
        f"rollout.max_inflight_groups={(args.staleness + 1) * (args.batch // args.group_size)}",
        f"rollout.max_new_tokens={args.max_new_tokens}",
        "rollout.length_distribution=lognormal",
        f"rollout.length_median={args.length_median}",
        f"rollout.length_sigma={args.length_sigma}",
        f"rollout.length_seed={args.seed}",
        f"model.seq_length={args.seq_length}",
        # the tiny recipes' rotary table covers 128 positions
        f"model.max_position_embeddings={max(args.seq_length, 128)}",
        f"engine.threads={args.engine_threads}",
        f"engine.num_engines={args.engines}",
        "telemetry.flip_every=0",  # the router flip check is diagnostics, not the loop
        "telemetry.timeline=true",
        "telemetry.progress_interval_s=1000",
    ]


def compose(overrides: list[str]) -> Any:
    """The validated config `python -m moerl.launch OVERRIDES` would run."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    from moerl.config.store import register_configs
    from moerl.validate import validate_config

    register_configs()
    with initialize_config_module(config_module="moerl.conf", version_base="1.3"):
        cfg = hydra_compose(config_name="config", overrides=overrides)
    return validate_config(cfg)


def run_once(overrides: list[str], run_dir: Path, trainer_threads: int) -> list[dict[str, Any]]:
    """One training run in `run_dir`; returns its metrics.jsonl entries."""
    from moerl.launch import run_rank
    from moerl.parallel.spawn import spawn
    from moerl.telemetry.metrics import read_metrics

    cfg = compose(overrides)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "overrides.json").write_text(json.dumps(overrides, indent=1))
    spawn(run_rank, cfg.launcher.world_size(), cfg, str(run_dir), threads=trainer_threads)
    return read_metrics(run_dir)


def summarize(metrics: list[dict[str, Any]], batch: int) -> dict[str, float]:
    """Loop wall time, trainer idle fraction, trained response tokens and per-step means
    of one run (`batch` completions per step)."""
    step_s = np.array([m["step_s"] for m in metrics])
    tokens = sum(m.get("trained_tokens", batch * m["response_len_mean"]) for m in metrics)
    idle = np.array([m["trainer_idle_frac"] for m in metrics])
    return {
        "loop_s": float(metrics[-1]["time_s"]),
        "steps": len(metrics),
        "trainer_idle": float((idle * step_s).sum() / step_s.sum()),
        "step_s_mean": float(step_s.mean()),
        "train_s_mean": float(((1 - idle) * step_s).mean()),
        "trained_tokens": float(tokens),
        "trained_tokens_per_s": float(tokens / metrics[-1]["time_s"]),
        "response_len_mean": float(np.mean([m["response_len_mean"] for m in metrics])),
        "staleness_max": float(max(m["staleness_max"] for m in metrics)),
        "reward_mean_last": float(metrics[-1]["reward_mean"]),
    }


def per_step(metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """What the reward-vs-wall-clock and staleness plots need from one run: per step
    (time_s, reward_mean), and tokens per version gap summed over the steps."""
    from moerl.telemetry.plots import staleness_counts

    return {
        "time_s": [float(m["time_s"]) for m in metrics],
        "reward_mean": [float(m["reward_mean"]) for m in metrics],
        "staleness_tokens": {str(k): v for k, v in staleness_counts(metrics).items()},
    }


def length_percentiles(overrides: list[str], groups: int) -> tuple[float, float]:
    """p50/p90 of the lengths drawn for the first `groups` prompts (what a run consumes)."""
    rollout = compose(overrides).rollout
    lengths = [
        rollout.completion_length(g, i) for g in range(groups) for i in range(rollout.group_size)
    ]
    p50, p90 = np.percentile(lengths, [50, 90])
    return float(p50), float(p90)


def plot(run_dir: Path, out_path: Path) -> None:
    from moerl.telemetry.plots import plot_timeline
    from moerl.telemetry.timeline import load_timeline

    plot_timeline(load_timeline(run_dir), out_path)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default=RECIPE)
    parser.add_argument("--steps", type=int, default=12, help="trainer steps per run")
    parser.add_argument("--staleness", type=int, default=2, help="max_staleness of the async run")
    parser.add_argument("--batch", type=int, default=16, help="trainer.global_batch_size")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=240)
    parser.add_argument("--length-median", type=int, default=6)
    parser.add_argument("--length-sigma", type=float, default=2.0)
    parser.add_argument("--seq-length", type=int, default=256, help="model.seq_length")
    parser.add_argument("--engines", type=int, default=1)
    parser.add_argument("--engine-threads", type=int, default=1)
    parser.add_argument("--trainer-threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--repeats", type=int, default=1, help="sync/async pairs (median)")
    parser.add_argument("--quick", action="store_true", help="a small workload (for tests)")
    parser.add_argument("--out", type=Path, help="write result.json and timeline plots here")
    args = parser.parse_args(argv)
    if args.quick:
        args.batch, args.group_size, args.max_new_tokens, args.seq_length = 8, 4, 24, 64
    if args.batch % args.group_size:
        parser.error(f"--batch={args.batch} is not a multiple of --group-size={args.group_size}")

    shared = workload(args)
    groups = args.steps * (args.batch // args.group_size)
    p50, p90 = length_percentiles(shared, groups)
    print(f"recipe={args.recipe} settings: {' '.join(shared[1:])}", flush=True)
    # run directories (metrics.jsonl, timelines, logs) are kept under --out
    root = args.out / "runs" if args.out else Path(tempfile.mkdtemp(prefix="moerl-avs-"))
    if args.out is not None and root.exists():
        shutil.rmtree(root)
    results: dict[str, Any] = {"overrides": shared, "len_p50": p50, "len_p90": p90}
    runs: dict[str, list[dict[str, Any]]] = {"sync": [], "async": []}
    try:
        # sync and async alternate, so load from other work on the machine hits both alike
        for rep in range(args.repeats):
            for name, staleness in (("sync", 0), ("async", args.staleness)):
                overrides = [*shared, f"staleness.max_staleness={staleness}"]
                load = os.getloadavg()[0]  # other work on the machine skews the comparison
                start = time.perf_counter()
                run_dir = root / f"{name}{rep}"
                metrics = run_once(overrides, run_dir, args.trainer_threads)
                run = {
                    "max_staleness": staleness,
                    "process_s": time.perf_counter() - start,
                    "loadavg_1m_before": load,
                    **summarize(metrics, args.batch),
                }
                runs[name].append(run)
                if rep == 0:
                    results.setdefault("per_step", {})[name] = per_step(metrics)
                print(f"{name}: {json.dumps(run)}", flush=True)
                if args.out is not None and rep == 0:
                    args.out.mkdir(parents=True, exist_ok=True)
                    plot(run_dir, args.out / f"timeline_{name}.png")
    finally:
        if args.out is None:
            shutil.rmtree(root, ignore_errors=True)
    for name, rs in runs.items():  # medians over the repeats
        results[name] = {k: float(np.median([r[k] for r in rs])) for k in rs[0]} | {"runs": rs}
    sync_s, async_s = results["sync"]["loop_s"], results["async"]["loop_s"]
    results["speedup"] = sync_s / async_s
    # async trains first on the groups that finish first (shorter ones), sync on exactly
    # the first prompts: trained tokens per second compares the work done
    results["token_speedup"] = (
        results["async"]["trained_tokens_per_s"] / results["sync"]["trained_tokens_per_s"]
    )
    print(
        f"sync_s={sync_s:.2f} async_s={async_s:.2f} speedup={results['speedup']:.2f} "
        f"trainer_idle_sync={results['sync']['trainer_idle']:.2f} "
        f"trainer_idle_async={results['async']['trainer_idle']:.2f} "
        f"len_p50={p50:.0f} len_p90={p90:.0f} token_speedup={results['token_speedup']:.2f} "
        f"(target: speedup >= 1.8, trainer_idle_async <= 0.2; steps={args.steps}, "
        f"max_staleness={args.staleness}, repeats={args.repeats})",
        flush=True,
    )
    if args.out is not None:
        (args.out / "result.json").write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
