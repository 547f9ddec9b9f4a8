"""Where an embedded-engine decode step goes, beside the transformers forward it wraps.

    python tools/gpu/profile_engine.py [--device cuda] [--requests 32] [--new-tokens 32]
                                       [--enable-cuda-graph]

Runs the tiny deepseek_moe checkpoint in an in-process engine, ``--requests`` concurrent
``/generate`` calls of ``--new-tokens`` each, and prints

- ``engine step ms`` (median of the decode steps after the profiled ones, unprofiled) and
  ``hf step ms``: transformers' own forward on the same batch through its own cache, plus
  the argmax read back (what ``generate`` does per token at least);
- ``aten ops/step`` and the 25 heaviest entries by self CPU time per step from
  ``torch.profiler`` over ten steps (with CUDA: the kernel launches and copies too).

On a small model a GPU step is bounded by what the CPU issues, so ops and launches per
step against the plain forward say where the engine's time goes (issue 28's engine rows).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

PROFILED = range(6, 16)  # scheduler steps 6..15: past the prefill and the first decodes


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument(
        "--enable-cuda-graph", action="store_true", help="decode steps replay CUDA graphs"
    )
    args = parser.parse_args(argv)
    if args.new_tokens < PROFILED.stop + 4:
        parser.error(f"--new-tokens {args.new_tokens}: at least {PROFILED.stop + 4}")

    import httpx
    import torch
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModelForCausalLM

    from moerl.engine.core.scheduler import Scheduler
    from moerl.engine.inprocess import InProcessEngine, engine_mounts
    from moerl.models.hf_tiny import save_tiny_checkpoint
    from moerl.models.tiny import tiny_config

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    cfg = dataclasses.replace(tiny_config("deepseek_moe"), max_position_embeddings=256)
    ckpt = save_tiny_checkpoint(cfg, Path(tempfile.mkdtemp(prefix="moerl_profile_")) / "hf")
    seen: dict = {"steps": 0, "s": []}
    step = Scheduler._step

    def timed_step(self: Scheduler) -> None:  # the profiler records the thread it starts in
        seen["steps"] += 1
        if seen["steps"] == PROFILED.start:
            seen["prof"] = profile(activities=acts)
            seen["prof"].__enter__()
        start = time.perf_counter()
        step(self)
        seen["s"].append((seen["steps"], time.perf_counter() - start))
        if seen["steps"] == PROFILED.stop - 1:
            seen["prof"].__exit__(None, None, None)

    Scheduler._step = timed_step  # type: ignore[method-assign]
    try:
        flags = ["--max-running-requests", "64", "--device", args.device]
        if args.enable_cuda_graph:
            flags.append("--enable-cuda-graph")
        engine = InProcessEngine(ckpt, *flags)

        async def generate() -> None:
            async with httpx.AsyncClient(mounts=engine_mounts([engine]), timeout=600) as c:
                params = {"max_new_tokens": args.new_tokens, "temperature": 1.0, "ignore_eos": True}
                outs = await asyncio.gather(*[
                    c.post(f"{engine.url}/generate",
                           json={"input_ids": [5 + i, 6, 7, 8], "sampling_params": params})
                    for i in range(args.requests)
                ])  # fmt: skip
                for out in outs:
                    out.raise_for_status()

        asyncio.run(generate())
        engine.close()
    finally:
        Scheduler._step = step  # type: ignore[method-assign]
    after = [s for n, s in seen["s"] if n >= PROFILED.stop and n < args.new_tokens]
    engine_ms = 1e3 * statistics.median(after)
    events = seen["prof"].key_averages()
    count = len(PROFILED)
    ops = sum(e.count for e in events if e.key.startswith("aten::")) / count
    print(f"engine step ms {engine_ms:.2f} (median of {len(after)} unprofiled decode steps)")
    print(f"aten ops/step {ops:.0f}")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:25]:
        print(f"  {e.key[:60]:60s} n/step={e.count / count:7.1f} "
              f"self_cpu_ms/step={e.self_cpu_time_total / count / 1e3:.3f}")  # fmt: skip

    hf = AutoModelForCausalLM.from_pretrained(str(ckpt)).eval().to(args.device)
    ids = torch.tensor([[5 + i, 6, 7, 8] for i in range(args.requests)], device=args.device)
    times = []
    with torch.no_grad():
        out = hf(input_ids=ids, use_cache=True)
        cache, token = out.past_key_values, torch.full((args.requests, 1), 3, device=args.device)
        for _ in range(PROFILED.stop + 10):
            start = time.perf_counter()
            out = hf(input_ids=token, past_key_values=cache, use_cache=True)
            out.logits[:, -1].argmax(-1).tolist()
            times.append(time.perf_counter() - start)
    hf_ms = 1e3 * statistics.median(times[PROFILED.stop :])
    print(f"hf step ms {hf_ms:.2f} (forward + argmax read back); engine/hf {engine_ms / hf_ms:.2f}")
    return {"engine_step_ms": engine_ms, "hf_step_ms": hf_ms, "aten_ops_per_step": ops}


if __name__ == "__main__":
    main()
