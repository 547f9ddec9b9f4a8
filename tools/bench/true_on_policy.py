"""True on-policy for MoE (issue 30): what the engine's batch-invariant mode
(``--enable-deterministic-inference``, moerl/engine/core/invariant.py) buys and costs.

    python tools/bench/true_on_policy.py [--quick] [--reps 5] [--new-tokens 16] [--out DIR]

Per family (deepseek_moe, qwen3_moe) and engine dtype (fp32, bf16), on tiny random
checkpoints, two engines in this process (the mode off and on; schedulers driven
directly, no HTTP; glibc's allocator kept as the engine process keeps it,
``launcher.malloc_keep_mb``):

- invariance: one greedy request run alone, beside 3 and beside 15 others, with its
  prompt from the prefix cache, with its prefill chunked, and as one sample of a group
  reading a shared prompt; a scenario counts when its tokens, logprobs and routes have
  the alone run's bits. Printed per setting as ``invariant_off=a/6 invariant_on=b/6``.
- engine overhead: a step's batch (4 prompts × 8 samples, ``--new-tokens`` each), the
  two engines alternating (``--reps`` × ``TINY_REPS`` times on the tiny shape, × 2 on
  tools/bench/engine.py's mid shape); the median wall time with the mode on over off
  (fp32).

- engine = trainer: per family, fp32 rollouts (8 prompts × ``--new-tokens``, temperature
  0.7, top-p 0.9, routes and kept sets recorded) scored by megatron-core with Keep Routing
  and the sampling mask (``moerl.checks.replay.score``), with both modes on
  (``--enable-deterministic-inference``, ``trainer.numerics=batch_invariant``) in each of
  the issue's 7 layouts (``--quick``: single), and in the single layout with both off:
  max |log π_trainer − log μ| and k3 over the trained tokens, and the single layout's
  trainer forward time on over off (``trainer_overhead``: the median of 10 forwards over
  all rollouts, micro-batched as the trainer does, by ``trainer.max_tokens_per_microbatch``,
  both numerics built in one process and timed alternately);
  the same for deepseek_moe on the mid shape, single layout (``trainer_overhead_mid``).

Then the same in bf16 (engine and trainer; checkpoint weights rounded to bf16 values), in
the single layout (not with ``--quick``); and the main job (``+recipe=deepseek_moe
staleness=sync``, ``--run-steps`` steps, 20; not with ``--quick``) with both modes on and
both off, two runs of each alternating (``MAIN_JOB_PAIRS``): reward per step, step time, k3
and abs_diff_max from metrics.jsonl.

Summary line: ``true_on_policy engine_invariant=N/M engine_overhead=… engine_overhead_mid=…
layouts_exact=… abs_diff_max=… abs_diff_max_off=… trainer_overhead=… trainer_overhead_mid=…
k3_on=… k3_off=… bf16_exact=… [run_step_overhead=…]``.
``layouts_exact`` counts the issue's 7 layouts × families whose trained tokens matched
exactly in fp32; ``bf16_exact`` the families matched exactly in bf16.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
TARGET_OVERHEAD = 1.35  # SGLang's deterministic mode: 34% (dense models, GPU)
LAYOUTS = ("single", "tp2", "ep2", "etp2ep2", "tp2ep2", "pp2", "dp2ep2")
MATCHED = LAYOUTS  # every layout of the issue
SAMPLING = {"temperature": 0.7, "top_p": 0.9, "top_k": -1}
FORWARD_REPEATS = 10
TINY_REPS = 4
"""The tiny shape's step takes ~0.1 s: it alternates this many times ``--reps`` (the mid
shape twice), since five medians of so short a step swung from 1.3x to 1.8x between runs
on 2 cores."""
RUN_FLAGS = ("engine.deterministic_inference=true", "trainer.numerics=batch_invariant")


def trainer_match(
    family: str,
    tmp: Path,
    prompts: int,
    new: int,
    layouts: tuple[str, ...],
    dtype: str = "float32",
    shape: dict[str, Any] | None = None,
    timed: bool = True,
    flags: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Engine vs trainer logprobs (kept-set, Keep Routing) with the engine in ``dtype``
    and the trainer in the same: both modes on in each of ``layouts`` (the first also
    both off); ``shape``: model config overrides (the tiny model's by default);
    ``timed``: also the trainer's forward time with the matching numerics over the
    default (``trainer_overhead``); ``flags``: more engine flags (``--device``)."""
    from moerl.checks.replay import collect_rollouts, forward_seconds, score
    from moerl.config.trainer import TrainerConfig
    from moerl.models.hf_tiny import save_tiny_checkpoint
    from moerl.models.tiny import tiny_config

    cfg = dataclasses.replace(tiny_config(family), **(shape or {}))
    name = f"{family}-mid" if shape else family  # the files' names
    hf = save_tiny_checkpoint(
        cfg, tmp / f"{name}-{dtype}-hf", seed=0, bf16_values=dtype == "bfloat16"
    )
    trainer_dtype = {"float32": "fp32", "bfloat16": "bf16"}[dtype]
    max_tokens = TrainerConfig().max_tokens_per_microbatch
    out: dict[str, Any] = {"layouts": {}}
    for mode, mode_flags, numerics in (
        ("on", ("--enable-deterministic-inference",), "batch_invariant"),
        ("off", (), "default"),
    ):
        rollouts = tmp / f"{name}-{dtype}-{mode}.jsonl"
        trajs = collect_rollouts(
            hf, rollouts, num_prompts=prompts, max_new_tokens=new, dtype=dtype,
            sampling=SAMPLING, flags=(*mode_flags, *flags),
        )  # fmt: skip
        trained = np.concatenate([t.trained for t in trajs])
        ref = np.concatenate([t.sampling_logprobs for t in trajs])[trained]
        for layout in layouts if mode == "on" else layouts[:1]:
            scored = tmp / f"{name}-{dtype}-{mode}-{layout}.json"
            # micro-batched as the trainer does (trainer.max_tokens_per_microbatch)
            setting = ("on", "on", {"max_tokens": max_tokens})
            score(layout, hf, rollouts, scored, settings=[setting], numerics=numerics,
                  dtype=trainer_dtype)  # fmt: skip
            payload = json.loads(scored.read_text())
            diff = np.abs(np.asarray(payload["logprobs"]["on/on"]) - ref)
            found = {
                "abs_diff_max": float(diff.max()),
                "exact_tokens": int((diff == 0).sum()),
                "tokens": len(diff),
                "k3": payload["settings"][0]["mismatch_k3"],
            }
            if mode == "on":
                out["layouts"][layout] = found
            if layout == layouts[0]:
                out[mode] = found
    out["exact"] = [k for k, v in out["layouts"].items() if v["abs_diff_max"] == 0.0]
    if not timed:
        return out
    # both numerics side by side in one process, alternating, on the mode-on rollouts
    seconds = forward_seconds(hf, tmp / f"{name}-{dtype}-on.jsonl", tmp / f"{name}-{dtype}-s.json",
                              trainer_dtype, FORWARD_REPEATS, max_tokens)  # fmt: skip
    out["forward_s"] = seconds
    on, off = (statistics.median(seconds[k]) for k in ("batch_invariant", "default"))
    out["trainer_overhead"] = on / off
    return out


MAIN_JOB_PAIRS = 2
"""Runs of the main job per mode, alternating (on, off, then off, on): with one run per
mode the row read 1.16x and 1.64x an hour apart (the off step took 90 ms in one and
133 ms in the other)."""


def main_job(
    tmp: Path, steps: int, timeout_s: int = 1200, pairs: int = MAIN_JOB_PAIRS
) -> dict[str, Any]:
    """The main job (``+recipe=deepseek_moe staleness=sync``, the tiny model) for ``steps``
    steps with both modes on (``RUN_FLAGS``) and with both off, ``pairs`` runs of each,
    alternating: per step of each mode's first run the reward, the step time, k3 and max
    |log π_trainer − log μ| from its metrics.jsonl; ``step_overhead`` is the median step
    time over every run with the modes on over the same with them off (each run's first
    step left out: it carries the first forward's warm-up), ``run_medians_s`` each run's
    median step time."""
    from moerl.telemetry.metrics import read_metrics

    out: dict[str, Any] = {}
    warm = slice(1, None)
    steps_s: dict[str, list[float]] = {"on": [], "off": []}
    medians: dict[str, list[float]] = {"on": [], "off": []}
    order = [m for i in range(pairs) for m in (("on", "off") if i % 2 == 0 else ("off", "on"))]
    for i, mode in enumerate(order):
        flags = RUN_FLAGS if mode == "on" else ()
        run = tmp / f"run-{mode}-{i}"
        cmd = [sys.executable, "-m", "moerl.launch", "+recipe=deepseek_moe", "staleness=sync",
               f"trainer.train_iters={steps}", "eval.every=0", "trainer.checkpoint_dir=null",
               "telemetry.progress_interval_s=1000", f"hydra.run.dir={run}", *flags]  # fmt: skip
        proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode:
            raise RuntimeError(f"main job ({mode}) exited with {proc.returncode}:\n"
                               f"{proc.stderr[-3000:]}")  # fmt: skip
        rows = read_metrics(run)
        data = {
            "reward": [r["reward_mean"] for r in rows],
            "step_s": [r["step_s"] for r in rows],
            "k3": [r["mismatch/k3"] for r in rows],
            "abs_diff_max": [r["mismatch/abs_diff_max"] for r in rows],
        }
        out.setdefault(mode, data)
        steps_s[mode].extend(data["step_s"][warm])
        medians[mode].append(statistics.median(data["step_s"][warm]))
    out["step_overhead"] = statistics.median(steps_s["on"]) / statistics.median(steps_s["off"])
    out["run_medians_s"] = medians
    return out


def _num(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def _mid_shape() -> dict[str, Any]:
    spec = importlib.util.spec_from_file_location("moerl_bench_engine_shape", HERE / "engine.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return dict(module.MID_SHAPE)


def _generate(sched: Any, batch: list[tuple[list[int], int]], timeout_s: float = 300) -> list[Any]:
    """Submit (prompt, max_new_tokens) pairs at once, greedy, with output logprobs and
    routes; wait for every answer."""
    from moerl.engine.core.sampling import SamplingParams
    from moerl.engine.core.scheduler import Request

    left, done, lock = [len(batch)], threading.Event(), threading.Lock()

    def on_done(_: Any) -> None:
        with lock:
            left[0] -= 1
            if not left[0]:
                done.set()

    reqs = [
        Request(
            rid=f"r{i}",
            input_ids=list(prompt),
            on_done=on_done,
            return_logprob=True,
            logprob_start_len=len(prompt) - 1,
            params=SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True),
        )
        for i, (prompt, n) in enumerate(batch)
    ]
    sched.submit(*reqs)
    if not done.wait(timeout_s):
        raise TimeoutError(f"{left[0]} of {len(batch)} requests unanswered after {timeout_s} s")
    return reqs


def _session(runner: Any, batches: list[list[tuple[list[int], int]]], **kw: Any) -> list[Any]:
    from moerl.engine.core.prefix_cache import PrefixCache
    from moerl.engine.core.scheduler import Scheduler

    sched = Scheduler(runner, prefix_cache=PrefixCache(100_000), enable_routed_experts=True, **kw)
    sched.start()
    try:
        return [_generate(sched, b) for b in batches]
    finally:
        sched.shutdown()


def invariance(runner: Any, new: int, seed: int = 0) -> dict[str, bool]:
    """Scenario → whether the target request got the bits it gets alone."""
    rng = np.random.default_rng(seed)
    target = rng.integers(3, 100, 11).tolist()
    others = [rng.integers(3, 100, int(n)).tolist() for n in rng.integers(2, 30, 15)]
    t = (target, new)
    alone = _session(runner, [[t]])[0][0]
    got = {
        "beside_3": _session(runner, [[t] + [(o, new - 2) for o in others[:3]]])[0][0],
        "beside_15": _session(
            runner, [[(o, new - 3) for o in others[:7]] + [t] + [(o, new + 1) for o in others[7:]]]
        )[0][7],
        "prompt_cached": _session(runner, [[(target, 3)], [t]])[1][0],
        "chunked_prefill": _session(runner, [[t, (others[0], 4)]], chunked_prefill_size=4)[0][0],
        "shared_prompt": _session(runner, [[t] * 4], shared_prompt_min_tokens=1)[0][2],
    }

    def same(r: Any) -> bool:
        return (
            r.output_ids == alone.output_ids
            and r.logprobs == alone.logprobs
            and np.array_equal(np.concatenate(r.routes), np.concatenate(alone.routes))
        )

    return {"alone": True, **{k: same(r) for k, r in got.items()}}


def overhead(
    runners: dict[bool, Any], new: int, reps: int, vocab: int, seed: int = 1
) -> dict[str, float]:
    """Median wall time of a step's batch with the mode off and on, alternating."""
    rng = np.random.default_rng(seed)
    times: dict[bool, list[float]] = {False: [], True: []}
    for rep in range(reps + 1):
        prompts = [rng.integers(3, vocab, 24).tolist() for _ in range(4)]
        for mode, runner in runners.items():
            start = time.perf_counter()
            _session(runner, [[(p, new) for p in prompts for _ in range(8)]])
            if rep:  # the first round warms both up
                times[mode].append(time.perf_counter() - start)
    off, on = statistics.median(times[False]), statistics.median(times[True])
    return {"off_s": off, "on_s": on, "overhead": on / off}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one family, fp32, 3 reps")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: quiet)")
    parser.add_argument(
        "--run-steps",
        type=int,
        default=None,
        help="main-job steps with the modes on and off (default 20; --quick: 0)",
    )
    parser.add_argument(
        "--device",
        default="auto",
        help="the engines' and the trainer's device: 'cpu' hides any GPU from both; 'auto' "
        "(default) or 'cuda' runs both on this machine's GPU (the trainer takes it by itself)",
    )
    parser.add_argument(
        "--layouts", nargs="+", choices=LAYOUTS, default=None,
        help="the trainer's layouts (default: all 7; --quick: single)",
    )  # fmt: skip
    parser.add_argument("--no-mid", action="store_true", help="skip the mid shape")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.device == "cpu":  # before torch sees the GPU; spawned workers inherit it
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    from moerl.config.launcher import LauncherConfig
    from moerl.config.threads import keep_freed_memory

    # glibc's allocator as a run's processes have it (the engine's --malloc-keep-mb, the
    # launcher's launcher.malloc_keep_mb): without it each forward faulted its freed
    # tensors' pages in afresh, which the mode's extra temporaries paid more often
    # (tiny shape on/off 1.73x/1.51x without, 1.60x/1.37x with, one sitting)
    keep_freed_memory(LauncherConfig.malloc_keep_mb)
    import torch

    from moerl.engine.core.model_runner import ModelRunner
    from moerl.models.hf_tiny import save_tiny_checkpoint
    from moerl.models.tiny import tiny_config

    torch.set_num_threads(args.threads)
    families = ["deepseek_moe"] if args.quick else ["deepseek_moe", "qwen3_moe"]
    dtypes = ["float32"] if args.quick else ["float32", "bfloat16"]
    reps = min(args.reps, 3) if args.quick else args.reps
    result: dict[str, Any] = {"settings": {}, "target_overhead": TARGET_OVERHEAD}
    from moerl.device import name, resolve

    device = resolve(args.device)
    result["device"] = name() if device.type == "cuda" else "cpu"
    engine_flags = ("--device", str(device))
    with tempfile.TemporaryDirectory() as tmp:
        for family in families:
            cfg = tiny_config(family)
            path = save_tiny_checkpoint(cfg, Path(tmp) / family, seed=0)
            for dtype in dtypes:
                runners = {
                    m: ModelRunner(path, dtype=dtype, device=device, deterministic=m)
                    for m in (False, True)
                }
                setting: dict[str, Any] = {
                    "invariant_off": invariance(runners[False], args.new_tokens),
                    "invariant_on": invariance(runners[True], args.new_tokens),
                }
                if dtype == "float32":
                    tiny_reps = reps * TINY_REPS
                    setting["tiny"] = overhead(runners, args.new_tokens, tiny_reps, cfg.vocab_size)
                name = f"{family}/{dtype}"
                result["settings"][name] = setting
                off, on = (sum(setting[k].values()) for k in ("invariant_off", "invariant_on"))
                n = len(setting["invariant_on"])
                line = f"{name} invariant_off={off}/{n} invariant_on={on}/{n}"
                if "tiny" in setting:
                    line += f" overhead_tiny={setting['tiny']['overhead']:.2f}"
                print(line, flush=True)
        result["trainer"] = {}
        for family in families:
            layouts = tuple(args.layouts or (MATCHED[:1] if args.quick else MATCHED))
            match = trainer_match(
                family, Path(tmp), 8, args.new_tokens, layouts, flags=engine_flags
            )
            result["trainer"][family] = match
            for layout, found in match["layouts"].items():
                print(
                    f"{family} {layout} abs_diff_max={found['abs_diff_max']:.3g} exact_tokens="
                    f"{found['exact_tokens']}/{found['tokens']}",
                    flush=True,
                )
            print(
                f"{family} single off abs_diff_max={match['off']['abs_diff_max']:.3g} "
                f"trainer_overhead={match['trainer_overhead']:.2f}",
                flush=True,
            )
            if not args.quick:  # bf16 engine and trainer, single layout
                half = trainer_match(family, Path(tmp), 8, args.new_tokens, ("single",), "bfloat16",
                                     timed=False, flags=engine_flags)  # fmt: skip
                result.setdefault("trainer_bf16", {})[family] = half
                print(
                    f"{family} bf16 single abs_diff_max={half['on']['abs_diff_max']:.3g} "
                    f"(off: {half['off']['abs_diff_max']:.3g})",
                    flush=True,
                )
        run_steps = args.run_steps if args.run_steps is not None else (0 if args.quick else 20)
        if run_steps:
            job = result["run"] = main_job(Path(tmp), run_steps)
            for mode in ("on", "off"):
                curve = " ".join(f"{x:.2f}" for x in job[mode]["reward"])
                print(f"main job {mode}: reward per step {curve}; k3 mean="
                      f"{statistics.mean(job[mode]['k3']):.3g} abs_diff_max="
                      f"{max(job[mode]['abs_diff_max']):.3g}", flush=True)  # fmt: skip
            runs = " ".join(
                f"{m}={','.join(f'{1e3 * x:.0f}' for x in job['run_medians_s'][m])}ms"
                for m in ("on", "off")
            )
            print(f"main job step time on/off={job['step_overhead']:.2f} ({runs})", flush=True)
        if not args.no_mid:
            mid_match = trainer_match("deepseek_moe", Path(tmp), 8, args.new_tokens, ("single",),
                                      shape=_mid_shape(), flags=engine_flags)  # fmt: skip
            result["trainer_mid"] = mid_match
            print(f"deepseek_moe mid single abs_diff_max={mid_match['on']['abs_diff_max']:.3g} "
                  f"trainer_overhead={mid_match['trainer_overhead']:.2f}", flush=True)  # fmt: skip
            mid_cfg = dataclasses.replace(tiny_config("deepseek_moe"), **_mid_shape())
            mid = save_tiny_checkpoint(mid_cfg, Path(tmp) / "mid", seed=0)
            runners = {m: ModelRunner(mid, device=device, deterministic=m) for m in (False, True)}
            result["mid"] = overhead(runners, args.new_tokens, reps * 2, mid_cfg.vocab_size)
            print(f"deepseek_moe mid/float32 overhead={result['mid']['overhead']:.2f}", flush=True)
    settings = result["settings"].values()
    result["engine_invariant"] = sum(sum(s["invariant_on"].values()) for s in settings)
    result["engine_scenarios"] = sum(len(s["invariant_on"]) for s in settings)
    result["engine_invariant_off"] = sum(sum(s["invariant_off"].values()) for s in settings)
    tiny = [s["tiny"]["overhead"] for s in settings if "tiny" in s]
    result["engine_overhead"] = statistics.median(tiny)
    result["engine_overhead_mid"] = result["mid"]["overhead"] if "mid" in result else None
    trainer = result["trainer"].values()
    result["layouts_exact"] = sum(len(m["exact"]) for m in trainer)
    result["layouts_total"] = len(LAYOUTS) * len(result["trainer"])
    result["abs_diff_max"] = max(v["abs_diff_max"] for m in trainer for v in m["layouts"].values())
    result["abs_diff_max_off"] = max(m["off"]["abs_diff_max"] for m in trainer)
    result["trainer_overhead"] = statistics.median(m["trainer_overhead"] for m in trainer)
    result["trainer_overhead_mid"] = (
        result["trainer_mid"]["trainer_overhead"] if "trainer_mid" in result else None
    )
    result["k3_on"] = max(m["on"]["k3"] for m in trainer)
    result["k3_off"] = max(m["off"]["k3"] for m in trainer)
    if "run" in result:
        result["run_step_overhead"] = result["run"]["step_overhead"]
        result["run_k3_on"] = statistics.mean(result["run"]["on"]["k3"])
        result["run_k3_off"] = statistics.mean(result["run"]["off"]["k3"])
    halves = result.get("trainer_bf16", {}).values()
    result["bf16_exact"] = sum(len(m["exact"]) for m in halves)
    result["bf16_total"] = len(halves)
    print(
        f"true_on_policy engine_invariant={result['engine_invariant']}/{result['engine_scenarios']}"
        f" (off: {result['engine_invariant_off']}) engine_overhead={result['engine_overhead']:.2f}"
        f" engine_overhead_mid={_num(result['engine_overhead_mid'])}"
        f" layouts_exact={result['layouts_exact']}/{result['layouts_total']}"
        f" abs_diff_max={result['abs_diff_max']:.3g} abs_diff_max_off={result['abs_diff_max_off']:.3g}"
        f" trainer_overhead={result['trainer_overhead']:.2f}"
        f" trainer_overhead_mid={_num(result['trainer_overhead_mid'])}"
        f" k3_on={result['k3_on']:.3g} k3_off={result['k3_off']:.3g}"
        f" bf16_exact={result['bf16_exact']}/{result['bf16_total']}"
        + (f" run_step_overhead={result['run_step_overhead']:.2f}" if "run" in result else ""),
        flush=True,
    )
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "result.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parents[1]))
    main()
