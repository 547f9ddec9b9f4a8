"""moerl against TRL's GRPOTrainer on the main job: same checkpoint, prompts, reward, G,
batch, tokens, sampling and optimizer, each run its own process tree.

    python tools/bench/vs_trl.py [--steps 40] [--repeats 1] [--quick] [--threads N]
                                 [--placements recipe[,colocated|disaggregated]] [--out DIR]

Writes the tiny DeepSeek-MoE checkpoint once (moerl's tiny-model writer, seed 0) and
trains it three ways, alternating (trl, moerl_sync, moerl_async, trl, ...) so other work
on the machine hits all alike (each run records the load average before it):

- trl: `tools/bench/trl_grpo_runner.py`, TRL's GRPOTrainer (transformers' generate);
- moerl_sync: `python -m moerl.launch +recipe=deepseek_moe model.path=DIR staleness=sync`
  (the result records each run's largest staleness, which must be 0);
- moerl_async: the same command as the recipe ships it (max_staleness 1);
- every moerl run adds `trainer.checkpoint_dir=null`: TRL's runner saves nothing
  (`save_strategy="no"`), and moerl's default final checkpoint forks megatron-core's
  writer processes, whose copy-on-write pages count again in the tree's RSS (+400 MB);
- with `--placements recipe,disaggregated` (or any list), moerl_sync_<p> and
  moerl_async_<p> run the same with `launcher.placement=<p>`, in the same rotation, and a
  line `vs_trl placement=<p> … ratio_sync=… ratio_async=… startup_ratio=… memory_ratio=…`
  follows the summary.

Per run: s/step (median step wall time, skipping the first `skip` steps: the first holds
the first generation and warm-up), sequences/s (32 / s_step), startup (process start to
the training loop's start: TRL's on_train_begin, moerl's loop clock; first_step_s is to
the first step's end), time to reward 0.2 (process start to the end of the first step
whose trailing 3-step mean reward is >= 0.2; None if never), peak RSS of the whole
process tree (summed over the process and all its children, polled every 0.2 s: shared
pages such as torch's libraries count once per process) and the reward curve. Medians
over the repeats, then one line

    vs_trl trl_s_step=… moerl_sync_s_step=… moerl_async_s_step=… ratio_sync=…
    ratio_async=… startup_ratio=… memory_ratio=…

ratios = moerl / TRL: ratio_sync and ratio_async of s/step, startup_ratio of the median
startup over all moerl runs, memory_ratio of the larger of the two moerl peaks. A line
`vs_trl per_repeat ratio_sync=a,b,… ratio_async=…` follows with each repetition's runs
over its own TRL run (next to each other in time: their spread is the machine's), and
`vs_trl parts_ms trl: generate=… loss_forward=… backward=… optimizer=… | moerl_sync:
sync=… train=… wait=… | moerl_async: …`: where a steady step's time goes, the median
milliseconds of TRL's own calls (timed around them by the runner) and of moerl's
trainer spans (waiting for the batch, training, pushing). Targets
(printed beside, not asserted): ratio_sync <= 1.0, ratio_async <= 0.8, startup_ratio <=
1.5, memory_ratio <= 1.5.

What differs (a reader must know): TRL samples with transformers' `generate` in its own
process, alternating with training; moerl with its embedded engine process (KV cache,
continuous batching) and, async, overlapping generation with training. Loss: both are
GRPO advantages (group mean, Bessel std; eps 1e-4 in TRL, 1e-6 in moerl) into a PPO
clip 0.2 with a token mean over the batch, beta 0; moerl's recipe takes the old policy's
log-probs from the training forward (no extra forward) and weights tokens by truncated IS
min(pi_old/mu, 2) against the engine's log-probs; TRL with one update per generation
takes the ratio against its own detached log-probs (1) and has no IS. moerl packs the 32
sequences into micro-batches of trainer.max_tokens_per_microbatch padded tokens (one
here), TRL one batch of 32.
moerl's router updates the expert bias (aux-loss-free balancing) and replays the
engine's routes; transformers keeps the bias fixed. AdamW: HF exempts biases and norm
weights from weight decay, megatron biases and 1-D params. TRL skips the step-0
learning rate of 0 exactly as megatron does (both warm up linearly from 0 over 2 steps).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
RECIPE = "deepseek_moe"
BATCH = 32  # sequences per optimizer step (4 prompts x G=8), the recipe's and the runner's
REWARD_TARGET = 0.2
REWARD_WINDOW = 3
RUNS = ("trl", "moerl_sync", "moerl_async")
TARGETS = {"ratio_sync": 1.0, "ratio_async": 0.8, "startup_ratio": 1.5, "memory_ratio": 1.5}
MISSING = "TRL is not installed: pip install -e '.[bench]' (or 'trl>=1.16')"


def trl_missing() -> str | None:
    """Why the bench cannot run, or None."""
    return MISSING if importlib.util.find_spec("trl") is None else None


def write_checkpoint(out: Path, seed: int) -> Path:
    """The recipe's tiny DeepSeek-MoE (conf/model/deepseek_moe_tiny.yaml), random weights
    from `seed`, as an HF checkpoint both sides load."""
    from moerl.models.hf_tiny import save_tiny_checkpoint
    from moerl.models.tiny import tiny_config

    return save_tiny_checkpoint(tiny_config("deepseek_moe"), out, seed=seed)


class TreeMemory:
    """Peak summed RSS of a process and all its descendants, polled in a thread."""

    def __init__(self, pid: int, interval_s: float = 0.2) -> None:
        self.pid, self.interval_s = pid, interval_s
        self.peak_bytes, self.peak_procs = 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.pid)
        except psutil.NoSuchProcess:
            return
        while not self._stop.is_set():
            try:
                procs = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            total = 0
            for proc in procs:
                try:
                    total += proc.memory_info().rss
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue  # ended between the listing and the read
            if total > self.peak_bytes:
                self.peak_bytes, self.peak_procs = total, len(procs)
            self._stop.wait(self.interval_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class Steps:
    """One run's clock, from its own records: unix times of the loop's start and of each
    step's end, and each step's mean reward."""

    begin: float
    ends: list[float] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    staleness_max: float | None = None
    parts: list[dict[str, float]] = field(default_factory=list)
    """Each step's seconds by part: TRL's calls (trl_grpo_runner.py), moerl's trainer
    spans (timeline.trainer.jsonl: wait, train, sync)."""


MOERL_PARTS = ("wait", "train", "sync")
"""The trainer's timeline spans a step is made of (moerl/loop.py)."""


def read_trl(out: Path) -> Steps:
    lines = [json.loads(x) for x in (out / "steps.jsonl").read_text().splitlines() if x]
    begin = next(x["wall_time"] for x in lines if x.get("event") == "train_begin")
    steps = sorted((x for x in lines if "step" in x), key=lambda x: x["step"])
    parts = [dict(x.get("parts") or {}) for x in steps]
    return Steps(begin, [x["wall_time"] for x in steps], [x["reward"] for x in steps], None, parts)


def moerl_parts(run_dir: Path, steps: int) -> list[dict[str, float]]:
    """Each step's trainer spans (wait for the batch, train, sync: the push) from the
    run's timeline, in seconds."""
    parts: list[dict[str, float]] = [{} for _ in range(steps)]
    path = run_dir / "timeline.trainer.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        span = json.loads(line)
        step = span.get("step")
        if isinstance(step, int) and 0 <= step < steps and span["kind"] in MOERL_PARTS:
            kind = span["kind"]
            parts[step][kind] = parts[step].get(kind, 0.0) + span["end"] - span["start"]
    return parts


def read_moerl(run_dir: Path) -> Steps:
    from moerl.telemetry.metrics import read_metrics

    metrics = read_metrics(run_dir)
    # time_s counts from the loop's start (telemetry.runlog), wall_time is the same clock
    begin = metrics[0]["wall_time"] - metrics[0]["time_s"]
    return Steps(
        begin,
        [m["wall_time"] for m in metrics],
        [m["reward_mean"] for m in metrics],
        max(m["staleness_max"] for m in metrics),
        moerl_parts(run_dir, len(metrics)),
    )


def time_to_reward(steps: Steps, start: float) -> float | None:
    """Seconds from `start` to the end of the first step whose trailing mean reward over
    REWARD_WINDOW steps reaches REWARD_TARGET."""
    r = np.asarray(steps.rewards, dtype=float)
    for i in range(REWARD_WINDOW - 1, len(r)):
        if r[i - REWARD_WINDOW + 1 : i + 1].mean() >= REWARD_TARGET:
            return steps.ends[i] - start
    return None


def summarize(steps: Steps, start: float, skip: int) -> dict[str, Any]:
    """A run's numbers from its step clock (`start`: unix time the process started)."""
    durations = np.diff([steps.begin, *steps.ends])
    steady = durations[skip:] if len(durations) > skip else durations
    s_step = float(np.median(steady))
    kept = steps.parts[skip:] if len(steps.parts) > skip else steps.parts
    names = sorted({k for p in kept for k in p})
    return {
        # the steady steps' median seconds in each part (TRL's calls, moerl's spans)
        "parts_ms": {k: 1e3 * float(np.median([p.get(k, 0.0) for p in kept])) for k in names},
        "steps": len(steps.ends),
        "s_step": s_step,
        "seq_per_s": BATCH / s_step,
        "startup_s": steps.begin - start,
        "first_step_s": steps.ends[0] - start,
        "time_to_reward_s": time_to_reward(steps, start),
        "reward_last": float(np.mean(steps.rewards[-REWARD_WINDOW:])),
        "staleness_max": steps.staleness_max,
        "step_s": [float(d) for d in durations],
        "time_s": [float(t - start) for t in steps.ends],  # from the process's start
        "reward": [float(x) for x in steps.rewards],
    }


def run_names(placements: list[str]) -> tuple[str, ...]:
    """trl, then moerl sync and async for each placement (the first keeps the plain
    names the summary line reads: moerl_sync, moerl_async)."""
    names = ["trl", "moerl_sync", "moerl_async"]
    for p in placements[1:]:
        names += [f"moerl_sync_{p}", f"moerl_async_{p}"]
    return tuple(names)


def placement_of(name: str, placements: list[str]) -> str | None:
    """The launcher.placement a moerl run sets (None: the recipe's, for 'recipe')."""
    chosen = next((p for p in placements[1:] if name.endswith(f"_{p}")), placements[0])
    return None if chosen == "recipe" else chosen


def command(
    name: str, ckpt: Path, steps: int, out: Path, threads: int | None, placement: str | None = None
) -> list[str]:
    if name == "trl":
        cmd = [sys.executable, str(HERE / "trl_grpo_runner.py"), "--model", str(ckpt),
               "--steps", str(steps), "--out", str(out)]  # fmt: skip
        return cmd + (["--threads", str(threads)] if threads else [])
    cmd = [sys.executable, "-m", "moerl.launch", f"+recipe={RECIPE}", f"model.path={ckpt}",
           f"trainer.train_iters={steps}", f"hydra.run.dir={out}",
           "trainer.checkpoint_dir=null"]  # fmt: skip
    if threads:
        cmd.append(f"launcher.threads={threads}")
    if name.startswith("moerl_sync"):
        cmd.append("staleness=sync")
    if placement is not None:
        cmd.append(f"launcher.placement={placement}")
    return cmd


def run_once(name: str, cmd: list[str], out: Path, timeout_s: int) -> tuple[float, TreeMemory]:
    """Run `cmd` in its own session, polling its tree's memory; (start unix time, memory).
    Raises RuntimeError with the log's tail when it fails or times out."""
    out.mkdir(parents=True, exist_ok=True)
    log = out.parent / f"{out.name}.log"
    with log.open("w") as sink:
        start = time.time()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        memory = TreeMemory(proc.pid)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the run's own group: ranks, engines
            proc.wait()
            rc = None
        finally:
            memory.stop()
    if rc != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        why = f"timed out after {timeout_s}s" if rc is None else f"exited with {rc}"
        raise RuntimeError(f"{name} {why}; {log}:\n{tail}")
    return start, memory


def fmt(value: float | None, digits: int = 2) -> str:
    return "None" if value is None else f"{value:.{digits}f}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per run")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of the three runs")
    parser.add_argument("--quick", action="store_true", help="3 steps (smoke test)")
    parser.add_argument("--skip", type=int, default=None,
                        help="steps left out of s/step (default 2, 1 below 6 steps)")  # fmt: skip
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads of TRL and of moerl's trainer (default: all cores)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="the checkpoint's weights")
    parser.add_argument("--timeout-s", type=int, default=1800, help="per run")
    parser.add_argument("--out", type=Path, help="result.json, the runs and their logs")
    parser.add_argument(
        "--placements", default="recipe",
        help="comma-separated launcher.placement values for the moerl runs, side by side; "
        "the first is the headline ('recipe': as the recipe ships it), e.g. "
        "'recipe,disaggregated'",
    )  # fmt: skip
    args = parser.parse_args(argv)
    placements = [p.strip() for p in args.placements.split(",") if p.strip()]
    unknown = set(placements) - {"recipe", "colocated", "disaggregated"}
    if not placements or unknown or len(set(placements)) != len(placements):
        parser.error(f"--placements={args.placements!r}: distinct values of recipe, "
                     "colocated, disaggregated")  # fmt: skip
    args.placements = placements
    names = run_names(placements)
    if args.quick:
        args.steps = 3
    if args.steps < 3:  # the recipe's 2 warmup steps must be shorter than the schedule
        parser.error(f"--steps={args.steps}: at least 3 (the recipe warms up for 2)")
    skip = args.skip if args.skip is not None else (2 if args.steps >= 6 else 1)

    missing = trl_missing()
    if missing is not None:
        print(f"vs_trl skipped: {missing}", flush=True)
        result: dict[str, Any] = {"skipped": missing}
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
        return result

    root = args.out / "runs" if args.out else Path(tempfile.mkdtemp(prefix="moerl-vs-trl-"))
    if args.out is not None and root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    try:
        ckpt = write_checkpoint(root / "ckpt", args.seed)
        print(f"vs_trl: steps={args.steps} repeats={args.repeats} skip={skip} "
              f"threads={args.threads or os.cpu_count()} checkpoint={ckpt}", flush=True)  # fmt: skip
        for rep in range(args.repeats):
            for name in names:  # alternating, so load from other work hits all alike
                out = root / f"{name}{rep}"
                where = None if name == "trl" else placement_of(name, placements)
                cmd = command(name, ckpt, args.steps, out, args.threads, where)
                load = os.getloadavg()[0]
                start, memory = run_once(name, cmd, out, args.timeout_s)
                steps = read_trl(out) if name == "trl" else read_moerl(out)
                run = {
                    "loadavg_1m_before": load,
                    "peak_rss_mb": memory.peak_bytes / 2**20,
                    "peak_procs": memory.peak_procs,
                    **summarize(steps, start, skip),
                }
                runs[name].append(run)
                print(f"{name}[{rep}]: s_step={run['s_step']:.3f} startup_s="
                      f"{run['startup_s']:.1f} peak_rss_mb={run['peak_rss_mb']:.0f} "
                      f"time_to_reward_s={fmt(run['time_to_reward_s'], 1)} "
                      f"reward_last={run['reward_last']:.3f} load={load:.2f}", flush=True)  # fmt: skip
    finally:
        if args.out is None:
            shutil.rmtree(root, ignore_errors=True)
    result = report(runs, args, skip)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def median(values: list[Any]) -> float | None:
    kept = [v for v in values if v is not None]
    return float(np.median(kept)) if kept else None


def paired_ratios(moerl: list[dict[str, Any]], trl: list[dict[str, Any]]) -> list[float]:
    """s/step of each repetition's moerl run over its own TRL run, run next to it in the
    rotation: the load of that minute hits both (the machine's speed drifts by tens of
    percent within an hour, which a ratio of medians over the whole rotation mixes in)."""
    return [
        m["s_step"] / t["s_step"] for m, t in zip(moerl, trl) if m.get("s_step") and t.get("s_step")
    ]


def report(
    runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace, skip: int
) -> dict[str, Any]:
    """Medians per run kind, the ratios, the summary line; the result.json dict."""
    from importlib import metadata

    keys = ("s_step", "seq_per_s", "startup_s", "first_step_s", "time_to_reward_s",
            "peak_rss_mb", "reward_last", "loadavg_1m_before")  # fmt: skip
    result: dict[str, Any] = {
        "steps": args.steps,
        "repeats": args.repeats,
        "skip": skip,
        "threads": args.threads or os.cpu_count(),
        "batch": BATCH,
        "reward_target": REWARD_TARGET,
        "targets": TARGETS,
        "versions": {d: metadata.version(d) for d in ("trl", "transformers", "torch")},
    }
    for name, rs in runs.items():
        result[name] = {k: median([r[k] for r in rs]) for k in keys} | {"runs": rs}
        parts = sorted({k for r in rs for k in r.get("parts_ms", {})})
        result[name]["parts_ms"] = {k: median([r["parts_ms"].get(k) for r in rs]) for k in parts}
        result[name]["staleness_max"] = max((r["staleness_max"] or 0.0) for r in rs)
    result["placements"] = args.placements
    trl, sync, asyn = (result[n] for n in RUNS)
    # the mode does not change start-up: every moerl run counts; memory: the larger mode
    result["moerl"] = {
        "startup_s": median([r["startup_s"] for n in RUNS[1:] for r in runs[n]]),
        "peak_rss_mb": max(sync["peak_rss_mb"], asyn["peak_rss_mb"]),
    }
    result["ratio_sync"] = sync["s_step"] / trl["s_step"]
    result["ratio_async"] = asyn["s_step"] / trl["s_step"]
    for key, name in (("ratio_sync", RUNS[1]), ("ratio_async", RUNS[2])):
        result[f"{key}_per_repeat"] = paired_ratios(runs[name], runs["trl"])
    result["startup_ratio"] = result["moerl"]["startup_s"] / trl["startup_s"]
    result["memory_ratio"] = result["moerl"]["peak_rss_mb"] / trl["peak_rss_mb"]
    print(
        f"vs_trl trl_s_step={trl['s_step']:.3f} moerl_sync_s_step={sync['s_step']:.3f} "
        f"moerl_async_s_step={asyn['s_step']:.3f} ratio_sync={result['ratio_sync']:.2f} "
        f"ratio_async={result['ratio_async']:.2f} startup_ratio={result['startup_ratio']:.2f} "
        f"memory_ratio={result['memory_ratio']:.2f} "
        f"(targets: ratio_sync <= {TARGETS['ratio_sync']}, ratio_async <= "
        f"{TARGETS['ratio_async']}, startup_ratio <= {TARGETS['startup_ratio']}, memory_ratio "
        f"<= {TARGETS['memory_ratio']}; steps={args.steps}, repeats={args.repeats})",
        flush=True,
    )
    print(
        "vs_trl per_repeat "
        + " ".join(f"{k}={','.join(f'{v:.2f}' for v in result[f'{k}_per_repeat'])}"
                   for k in ("ratio_sync", "ratio_async")),
        flush=True,
    )  # fmt: skip
    print(
        "vs_trl time_to_reward_s "
        + " ".join(f"{n}={fmt(result[n]['time_to_reward_s'], 1)}" for n in RUNS)
        + " startup_s "
        + " ".join(f"{n}={result[n]['startup_s']:.1f}" for n in RUNS)
        + " peak_rss_mb "
        + " ".join(f"{n}={result[n]['peak_rss_mb']:.0f}" for n in RUNS)
        + f" moerl_sync_staleness_max={sync['staleness_max']:g}",
        flush=True,
    )
    print(
        "vs_trl parts_ms "
        + " | ".join(
            f"{n}: " + " ".join(f"{k}={fmt(v, 1)}" for k, v in result[n]["parts_ms"].items())
            for n in RUNS
        ),
        flush=True,
    )
    for p in args.placements[1:]:  # the other placements, same TRL runs
        psync, pasync = result[f"moerl_sync_{p}"], result[f"moerl_async_{p}"]
        other = {
            "ratio_sync": psync["s_step"] / trl["s_step"],
            "ratio_async": pasync["s_step"] / trl["s_step"],
            "startup_ratio": median([psync["startup_s"], pasync["startup_s"]]) / trl["startup_s"],
            "memory_ratio": max(psync["peak_rss_mb"], pasync["peak_rss_mb"]) / trl["peak_rss_mb"],
        }
        result[f"placement_{p}"] = other
        print(
            f"vs_trl placement={p} moerl_sync_s_step={psync['s_step']:.3f} "
            f"moerl_async_s_step={pasync['s_step']:.3f} "
            + " ".join(f"{k}={v:.2f}" for k, v in other.items()),
            flush=True,
        )
    if sync["staleness_max"] != 0:
        print(f"vs_trl WARNING: the sync runs trained on stale tokens (staleness_max="
              f"{sync['staleness_max']:g}); they were not synchronous", flush=True)  # fmt: skip
    return result


if __name__ == "__main__":
    main()
