"""A long-tailed reward model scored inline vs asynchronously: the trainer's idle time.

    python tools/bench/rewards.py [--steps 12] [--train-s 0.4] [--rm-median-s 0.3]
                                  [--rm-sigma 1.0] [--quick] [--out DIR]

Both runs generate with the real Orchestrator and RolloutBuffer on one embedded engine
(the tiny DeepSeek model), G completions per group, and score every group with the real
RewardModel client (batching, retries, metrics) whose transport is a fake-latency PRM: each
request sleeps a lognormal time (median --rm-median-s, sigma --rm-sigma: p90 ~3.6x the
median at sigma 1) and answers log(0.5) for every input token. The trainer is simulated:
a step takes a batch of --groups groups from the buffer and "trains" for --train-s
seconds (a sleep, so the two runs compare the scheduling, not the trainer's CPU use).

- inline: the orchestrator puts unscored groups; the trainer scores its batch with the RM
  (the batch's groups concurrently) before training on it. The reward model is on the
  critical path, as in a loop that scores after generation and before the update.
- async: the orchestrator scores each group in its own task before putting it (moerl's
  design: rollout.reward_model, the "reward_model" span); the trainer only takes scored
  groups from the buffer.

Prints one line

    trainer_idle_inline=… trainer_idle_async=… step_s_inline=… step_s_async=…
    rm_latency_p50=… rm_latency_p90=…

trainer_idle_*: time the trainer was not training (waiting for a batch, and inline also
for its scoring) over the loop's time, after a first warm-up step; step_s_*: mean step
time. Target: trainer_idle_async <= 0.2 where trainer_idle_inline > 0.5.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np


class LognormalPRM:
    """A fake-latency PRM transport (the sleep is the RM's latency, the answer a constant
    logprob); one latency draw per request, from a seeded generator."""

    def __init__(self, median_s: float, sigma: float, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.median_s, self.sigma = median_s, sigma
        self.latencies: list[float] = []

    async def __call__(self, url: str, body: dict[str, Any], timeout_s: float) -> Any:
        delay = float(self.median_s * math.exp(self.sigma * self.rng.standard_normal()))
        self.latencies.append(delay)
        await asyncio.sleep(delay)
        rows = [[[math.log(0.5), t, ""] for t in ids] for ids in body["input_ids"]]
        return [{"text": "", "meta_info": {"input_token_logprobs": r}} for r in rows]


async def _run(mode: str, url: str, args: argparse.Namespace) -> dict[str, Any]:
    from moerl.config.buffer import BufferConfig, StalenessConfig
    from moerl.config.reward_model import RewardModelConfig
    from moerl.config.rollout import RolloutConfig
    from moerl.models.tokenizer import build_tiny_tokenizer
    from moerl.rollout import EngineClient
    from moerl.rollout.buffer import RolloutBuffer
    from moerl.rollout.orchestrator import Orchestrator
    from moerl.rollout.reward_model import RewardModel
    from moerl.tasks import build_task

    tok = build_tiny_tokenizer()
    task = build_task("copy_digits", tok)
    prm = LognormalPRM(args.rm_median_s, args.rm_sigma, seed=args.seed)
    rm_cfg = RewardModelConfig(
        enabled=True, step_delimiter=",", batch_size=args.group_size, linger_s=0.0,
        max_concurrency=64, timeout_s=120.0,
    )  # fmt: skip
    rm = RewardModel(rm_cfg, tok, ["http://fake-rm"], transport=prm)
    cfg = RolloutConfig(
        group_size=args.group_size, max_inflight_groups=args.inflight, max_new_tokens=16,
        return_routed_experts=False,
    )  # fmt: skip
    buffer = RolloutBuffer(
        BufferConfig(max_groups=args.inflight * 2), StalenessConfig(throttle=False)
    )
    async with EngineClient([url]) as client:
        orch = Orchestrator(
            client, task, buffer, cfg, num_layers=4, topk=4,
            reward_model=rm if mode == "async" else None,
        )  # fmt: skip
        runner = asyncio.create_task(orch.run())
        idle = steps_s = 0.0
        step_times: list[float] = []
        try:
            for step in range(args.steps + 1):  # step 0 warms up (the first generation)
                t0 = time.perf_counter()
                groups = await buffer.get_batch(args.groups, 0)
                if mode == "inline":
                    await asyncio.gather(*(rm.score(_prompt(g), g) for g in groups))
                waited = time.perf_counter() - t0
                await asyncio.sleep(args.train_s)  # the simulated train step
                if step > 0:
                    idle += waited
                    steps_s += time.perf_counter() - t0
                    step_times.append(time.perf_counter() - t0)
        finally:
            await orch.stop()
            await runner
            await rm.aclose()
    return {
        "idle_frac": idle / steps_s,
        "step_s": float(np.mean(step_times)),
        "rm_latencies": prm.latencies,
    }


def _prompt(group: list[Any]) -> Any:
    from moerl.tasks.base import Prompt

    t = group[0]
    return Prompt(int(t.group_id), t.prompt_ids)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--groups", type=int, default=2, help="groups per trainer step")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--inflight", type=int, default=16, help="rollout.max_inflight_groups")
    parser.add_argument("--train-s", type=float, default=0.4)
    parser.add_argument("--rm-median-s", type=float, default=0.3)
    parser.add_argument("--rm-sigma", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="6 steps")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps = min(args.steps, 6)

    from moerl.engine.process import EngineProcess
    from moerl.models.hf_tiny import save_tiny_checkpoint
    from moerl.models.tiny import tiny_config

    with tempfile.TemporaryDirectory(prefix="moerl-bench-rewards-") as tmp:
        ckpt = save_tiny_checkpoint(tiny_config("deepseek_moe"), Path(tmp) / "hf", seed=0)
        with EngineProcess(ckpt, threads=1) as engine:
            runs = {m: asyncio.run(_run(m, engine.url, args)) for m in ("inline", "async")}
    lat = [x for r in runs.values() for x in r.pop("rm_latencies")]
    results: dict[str, Any] = {
        "trainer_idle_inline": runs["inline"]["idle_frac"],
        "trainer_idle_async": runs["async"]["idle_frac"],
        "step_s_inline": runs["inline"]["step_s"],
        "step_s_async": runs["async"]["step_s"],
        "rm_latency_p50": float(np.percentile(lat, 50)),
        "rm_latency_p90": float(np.percentile(lat, 90)),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
    }
    print(
        f"settings: steps={args.steps} groups/step={args.groups} G={args.group_size} "
        f"train_s={args.train_s} rm lognormal median={args.rm_median_s}s sigma={args.rm_sigma}"
    )
    print(" ".join(f"{k}={v:.3f}" for k, v in results.items() if isinstance(v, float)))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "result.json").write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
