"""Multi-turn episodes with long-tailed environment latency: asynchronous vs synchronous RL.

    python tools/bench/episodes.py [--steps 8] [--staleness 3] [--median-s 0.3] [--sigma 1.5]
                                   [--turns 3] [--quick] [--out DIR]

Runs the recipe twice, on the same settings and seed, each rollout a 3-turn guess_number
episode whose every env step first waits a lognormal latency (tools/bench/latency_env.py:
median --median-s, p90 >= 5x the median for --sigma >= 1.26, seeded per prompt, episode and
turn so both runs wait the same latencies): synchronously (staleness.max_staleness=0: each
step's episodes are played with the current weights while the trainer waits, so every step
waits for its slowest episode) and asynchronously (max_staleness=K: generation runs up to K
versions ahead, (K+1) steps of episodes in flight, so env waits overlap each other and
training). The real loop runs (moerl.launch's rank entry in-process, as async_vs_sync.py),
on the tiny model and the embedded engine.

Then an engine-level measurement of one episode turn: each turn sends the whole stream so
far (a prompt, then each turn's output and an observation) and generates a few tokens. When
the engine accepts --disable-radix-cache (the prefix cache), two engines alternate turns,
one reusing the previous turn's prefix and one prefilling it all:
turn_prefix_reuse_speedup = median turn time without reuse / with. An engine without the
flag has no prefix cache: the bench reports the turn time per context length and
turn_prefix_reuse_speedup=n/a.

Prints the settings, one line per run, and one summary line

    episodes_per_s_sync=… episodes_per_s_async=… speedup=… trainer_idle_async=…
    trained_tokens_per_s_sync=… trained_tokens_per_s_async=… turn_prefix_reuse_speedup=…
    env_latency_p50=… env_latency_p90=…

episodes_per_s: episodes trained (steps x batch) over the loop's wall time (metrics.jsonl
`time_s` of the last step: engine and process start-up excluded). speedup = async / sync
episodes per second (target >= 2x). trained_tokens_per_s: the policy's own tokens the
trainer trained on per second (metrics.jsonl `trained_tokens`: an episode's actions, not
the observations spliced between them). env_latency_p50 / p90: of one env step.
--out DIR keeps the run directories (DIR/runs) and writes DIR/result.json.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RECIPE = "deepseek_moe"
RADIX_FLAG = "--disable-radix-cache"


def importable_here() -> None:
    """tools/bench on sys.path (this process) and PYTHONPATH (spawned ranks, engines), so
    `latency_env` and `async_vs_sync` import by name."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if str(HERE) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), *filter(None, paths)])


def workload(args: argparse.Namespace) -> list[str]:
    """Overrides shared by both runs (everything but the staleness bound)."""
    groups_per_step = args.batch // args.group_size
    return [
        f"+recipe={args.recipe}",
        "env=custom",
        "env._target_=latency_env.make",
        f"+env.options.median_s={args.median_s}",
        f"+env.options.sigma={args.sigma}",
        f"+env.options.turns={args.turns}",
        f"+env.options.seed={args.seed}",
        f"env.max_turns={args.turns}",
        f"trainer.train_iters={args.steps}",
        f"trainer.global_batch_size={args.batch}",
        f"trainer.seed={args.seed}",
        f"rollout.group_size={args.group_size}",
        # room for max(staleness)+1 steps of episodes in flight, in both runs
        f"rollout.max_inflight_groups={(args.staleness + 1) * groups_per_step}",
        f"rollout.max_new_tokens={args.max_new_tokens}",
        f"model.seq_length={args.seq_length}",
        f"model.max_position_embeddings={max(args.seq_length, 128)}",
        f"engine.threads={args.engine_threads}",
        "telemetry.flip_every=0",
        "telemetry.progress_interval_s=1000",
    ]


def run_pair(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """The sync and the async run; per run its summary."""
    import async_vs_sync as avs

    shared = workload(args)
    print(f"recipe={args.recipe} settings: {' '.join(shared[1:])}", flush=True)
    runs: dict[str, Any] = {"overrides": shared}
    for name, staleness in (("sync", 0), ("async", args.staleness)):
        load = os.getloadavg()[0]  # other work on the machine skews the comparison
        start = time.perf_counter()
        overrides = [*shared, f"staleness.max_staleness={staleness}"]
        metrics = avs.run_once(overrides, root / name, args.trainer_threads)
        run = {"max_staleness": staleness, "process_s": time.perf_counter() - start,
               "loadavg_1m_before": load, **avs.summarize(metrics, args.batch)}  # fmt: skip
        run["episodes"] = run["steps"] * args.batch
        run["episodes_per_s"] = run["episodes"] / run["loop_s"]
        for key in ("episode/turns_mean", "episode/env_step_s"):
            values = [m[key] for m in metrics if key in m]
            run[key.replace("/", "_")] = statistics.fmean(values) if values else None
        runs[name] = run
        print(f"{name}: {json.dumps(run)}", flush=True)
    return runs


# ---- one episode turn, with and without prefix reuse ----------------------------------


def engine_has_radix_flag() -> bool:
    """The embedded engine accepts --disable-radix-cache (it has a prefix cache)."""
    out = subprocess.run([sys.executable, "-m", "moerl.engine", "--help"], capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    return RADIX_FLAG in out.stdout


async def _play(urls: dict[str, str], prompts: list[list[int]], observations: list[list[int]],
                step: int) -> tuple[dict[str, list[tuple[int, float]]], list[int]]:  # fmt: skip
    """Each prompt played as an episode on every engine, turn by turn alternating engines;
    per engine (context length, seconds) of every turn after the first, and the cached
    tokens the engines reported for them."""
    from moerl.rollout import EngineClient

    sampling = {"max_new_tokens": step, "temperature": 0.0, "ignore_eos": True}
    times: dict[str, list[tuple[int, float]]] = {name: [] for name in urls}
    cached: list[int] = []
    clients = {name: EngineClient([url]) for name, url in urls.items()}
    try:
        for client in clients.values():  # lazy initialisation is not timed
            await client.generate([5, 6], {"max_new_tokens": 2}, return_logprob=False)
        for prompt in prompts:
            streams = {name: list(prompt) for name in urls}
            for turn, observation in enumerate(observations):
                for name, client in clients.items():
                    start = time.perf_counter()
                    out = await client.generate(streams[name], sampling, return_logprob=False)
                    if turn:  # the first turn has nothing to reuse
                        times[name].append((len(streams[name]), time.perf_counter() - start))
                        if name == "reuse":
                            cached.append(int(out["meta_info"].get("cached_tokens", 0)))
                    streams[name] += [*out["output_ids"], *observation]
    finally:
        for client in clients.values():
            await client.aclose()
    return times, cached


def turn_cost(family: str, threads: int, context: int, turns: int, step: int,
              episodes: int, tmp: Path) -> dict[str, Any]:  # fmt: skip
    """An episode turn's time, with and without prefix reuse when the engine can do both."""
    import numpy as np

    from moerl.engine.process import EngineProcess
    from moerl.models.hf_tiny import save_tiny_checkpoint
    from moerl.models.tiny import tiny_config

    positions = context + (turns + 1) * 2 * step
    cfg = dataclasses.replace(tiny_config(family), max_position_embeddings=max(positions, 128))
    model_dir = save_tiny_checkpoint(cfg, tmp / "hf-turns")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size, context).tolist() for _ in range(episodes)]
    observations = [rng.integers(3, cfg.vocab_size, step).tolist() for _ in range(turns)]
    radix = engine_has_radix_flag()
    engines = {"reuse": EngineProcess(model_dir, threads=threads)}
    try:
        if radix:
            engines["full"] = EngineProcess(model_dir, RADIX_FLAG, threads=threads)
        urls = {name: e.url for name, e in engines.items()}
        times, cached = asyncio.run(_play(urls, prompts, observations, step))
    finally:
        for engine in engines.values():
            engine.close()
    by_context: dict[int, list[float]] = {}
    for n, s in times["reuse"]:
        by_context.setdefault(n, []).append(s)
    result: dict[str, Any] = {
        "radix_flag": radix,
        "turn_context": context,
        "turn_new_tokens": step,
        "turn_ms_by_context": {
            str(n): 1000 * statistics.median(s) for n, s in sorted(by_context.items())
        },  # fmt: skip
        "turn_ms_prefix_reuse": None,
        "turn_ms_full_prefill": None,
        "turn_prefix_reuse_speedup": None,
    }
    if radix:
        reuse = statistics.median(s for _, s in times["reuse"])
        full = statistics.median(s for _, s in times["full"])
        result.update(turn_ms_prefix_reuse=1000 * reuse, turn_ms_full_prefill=1000 * full,
                      turn_prefix_reuse_speedup=full / reuse,
                      turn_cached_tokens_median=statistics.median(cached))  # fmt: skip
    else:  # no prefix cache: every turn prefills its whole context
        result["turn_ms_full_prefill"] = 1000 * statistics.median(s for _, s in times["reuse"])
    return result


def _fmt(value: Any, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default=RECIPE)
    parser.add_argument("--steps", type=int, help="trainer steps per run (8; quick: 6)")
    parser.add_argument("--staleness", type=int, default=3, help="max_staleness of the async run")
    parser.add_argument("--batch", type=int, help="trainer.global_batch_size (16; quick: 8)")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3, help="env steps per episode")
    parser.add_argument("--median-s", type=float, default=0.3, help="median env step latency")
    parser.add_argument("--sigma", type=float, default=1.5, help="lognormal spread (log space)")
    parser.add_argument("--max-new-tokens", type=int, default=8, help="tokens per turn")
    parser.add_argument("--seq-length", type=int, default=128, help="model.seq_length")
    parser.add_argument("--engine-threads", type=int, default=1)
    parser.add_argument("--trainer-threads", type=int, default=1)
    parser.add_argument("--turn-context", type=int, help="prompt tokens (turns; 384, quick: 96)")
    parser.add_argument("--turn-episodes", type=int, help="episodes timed (turns; 3, quick: 2)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--quick", action="store_true", help="a small workload (for tests)")
    parser.add_argument("--out", type=Path, help="write result.json here")
    args = parser.parse_args(argv)
    # --quick picks smaller defaults; a flag given explicitly wins
    defaults = {"steps": 8, "batch": 16, "turn_context": 384, "turn_episodes": 3}
    quick = {"steps": 6, "batch": 8, "turn_context": 96, "turn_episodes": 2}
    for key, value in (quick if args.quick else defaults).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.batch % args.group_size:
        parser.error(f"--batch={args.batch} is not a multiple of --group-size={args.group_size}")
    importable_here()
    from latency_env import latency_quantiles

    p50, p90 = latency_quantiles(args.median_s, args.sigma)
    root = args.out / "runs" if args.out else Path(tempfile.mkdtemp(prefix="moerl-episodes-"))
    if args.out is not None and root.exists():
        shutil.rmtree(root)
    try:
        results = run_pair(args, root)
        with tempfile.TemporaryDirectory() as tmp:
            results["turns"] = turn_cost(RECIPE, args.engine_threads, args.turn_context, 4, 16,
                                         args.turn_episodes, Path(tmp))  # fmt: skip
    finally:
        if args.out is None:
            shutil.rmtree(root, ignore_errors=True)
    sync, asyn, turns = results["sync"], results["async"], results["turns"]
    results.update(
        env_latency_p50=p50, env_latency_p90=p90,
        speedup=asyn["episodes_per_s"] / sync["episodes_per_s"],
        token_speedup=asyn["trained_tokens_per_s"] / sync["trained_tokens_per_s"],
        turn_prefix_reuse_speedup=turns["turn_prefix_reuse_speedup"],
    )  # fmt: skip
    print(f"turns: {json.dumps(turns)}", flush=True)
    print(
        f"episodes_per_s_sync={sync['episodes_per_s']:.3f} "
        f"episodes_per_s_async={asyn['episodes_per_s']:.3f} speedup={results['speedup']:.2f} "
        f"trainer_idle_async={asyn['trainer_idle']:.2f} "
        f"trained_tokens_per_s_sync={sync['trained_tokens_per_s']:.1f} "
        f"trained_tokens_per_s_async={asyn['trained_tokens_per_s']:.1f} "
        f"turn_prefix_reuse_speedup={_fmt(results['turn_prefix_reuse_speedup'])} "
        f"env_latency_p50={p50:.3f} env_latency_p90={p90:.3f} "
        f"(target: speedup >= 2; steps={args.steps}, batch={args.batch}, turns={args.turns}, "
        f"max_staleness={args.staleness})",
        flush=True,
    )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "result.json").write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
