"""Routed experts as two grouped GEMMs vs megatron-core's loop over experts, side by side.

    python tools/bench/grouped_experts.py [--device cpu|cuda] [--shapes tiny mid]
        [--dtypes fp32 bf16] [--reps 10] [--tokens 384] [--out DIR]

Builds the DeepSeek-MoE model of each shape (``tiny``: the recipe's; ``mid``: the
~40M-parameter shape of tools/bench/engine.py) twice in one process (one rank) with
the same weights, ``trainer.expert_gemm=loop`` and ``=grouped``
(``moerl.models.grouped_experts``), and times the model's forward + backward on the
same random batch, alternating the two, median of ``--reps`` after a warm-up. Also
compares their logits and gradients (on CPU they are bitwise equal; on CUDA the grouped
kernel sums in another order). One line per case,

    grouped_experts device=… shape=… dtype=… loop_ms=… grouped_ms=… speedup=… logits_rel=… grad_rel=…

(speedup = loop / grouped). This decides ``trainer.expert_gemm=auto``: grouped where it
is at least as fast and exact.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))


def _config(shape: str) -> Any:
    from moerl.models.tiny import tiny_config

    cfg = tiny_config("deepseek_moe")
    if shape == "mid":
        sys.path.insert(0, str(HERE))
        from engine import MID_SHAPE  # type: ignore[import-not-found]

        cfg = dataclasses.replace(cfg, **MID_SHAPE)
    return cfg


def _rel(a: Any, b: Any) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def case(shape: str, dtype: str, tokens: int, reps: int, root: Path) -> dict[str, Any]:
    import torch

    from moerl import device
    from moerl.convert import HFCheckpoint, load_hf
    from moerl.models import get_family
    from moerl.models.gpt import build_model
    from moerl.models.hf_tiny import save_tiny_checkpoint
    from moerl.parallel import initialize_model_parallel, parse_layout

    hf = save_tiny_checkpoint(_config(shape), root / f"hf-{shape}", seed=0)
    cfg = get_family("deepseek_moe").from_hf(HFCheckpoint(hf).config())  # as the trainer reads it
    pcfg, _ = parse_layout("single")
    initialize_model_parallel(
        pcfg, num_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups, num_experts=cfg.num_experts,
    )  # fmt: skip
    dev = device.device()
    models = {}
    for gemm in ("loop", "grouped"):
        chunks = build_model(cfg, pcfg, dtype, expert_gemm=gemm)
        load_hf(chunks, hf, cfg)
        models[gemm] = chunks[0]
    gen = torch.Generator().manual_seed(0)
    seq = 32
    ids = torch.randint(0, cfg.vocab_size, (max(1, tokens // seq), seq), generator=gen).to(dev)
    pos = torch.arange(seq, device=dev).expand_as(ids)
    weights = torch.randn(*ids.shape, cfg.vocab_size, generator=gen).to(dev)

    def run(gemm: str) -> tuple[Any, dict[str, Any]]:
        model = models[gemm]
        model.zero_grad()
        logits = model(ids, pos, None)
        (logits.float() * weights).sum().backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        return logits.detach(), grads

    def timed(gemm: str) -> float:
        device.synchronize()
        start = time.perf_counter()
        run(gemm)
        device.synchronize()
        return time.perf_counter() - start

    ref_logits, ref_grads = run("loop")
    logits, grads = run("grouped")
    exact = torch.equal(logits, ref_logits) and all(
        torch.equal(grads[n], ref_grads[n]) for n in ref_grads
    )
    result = {
        "shape": shape, "dtype": dtype, "device": dev.type, "tokens": int(ids.numel()),
        "logits_rel": _rel(logits, ref_logits),
        "grad_rel": max(_rel(grads[n], ref_grads[n]) for n in ref_grads),
        "bitwise": exact,
    }  # fmt: skip
    times: dict[str, list[float]] = {"loop": [], "grouped": []}
    for rep in range(reps):
        for gemm in ("loop", "grouped") if rep % 2 == 0 else ("grouped", "loop"):
            times[gemm].append(timed(gemm))
    result["loop_ms"] = statistics.median(times["loop"]) * 1e3
    result["grouped_ms"] = statistics.median(times["grouped"]) * 1e3
    result["speedup"] = result["loop_ms"] / result["grouped_ms"]
    return result


def line(r: dict[str, Any]) -> str:
    return (
        f"grouped_experts device={r['device']} shape={r['shape']} dtype={r['dtype']} "
        f"loop_ms={r['loop_ms']:.1f} grouped_ms={r['grouped_ms']:.1f} "
        f"speedup={r['speedup']:.2f} logits_rel={r['logits_rel']:.1e} "
        f"grad_rel={r['grad_rel']:.1e} bitwise={r['bitwise']}"
    )


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--shapes", nargs="+", default=["tiny"], choices=("tiny", "mid"))
    parser.add_argument("--dtypes", nargs="+", default=["fp32"], choices=("fp32", "bf16"))
    parser.add_argument("--tokens", type=int, default=384, help="tokens per forward")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (cpu device)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    import os

    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch

    from moerl import device
    from moerl.parallel.spawn import single_process_world
    from moerl.parallel.state import destroy

    if args.device == "cuda" and not device.has_cuda():
        parser.error("--device cuda: this machine has no CUDA device")
    torch.set_num_threads(args.threads) if args.device == "cpu" else None
    single_process_world()
    results = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for shape in args.shapes:
                for dtype in args.dtypes:
                    results.append(case(shape, dtype, args.tokens, args.reps, Path(tmp)))
                    print(line(results[-1]), flush=True)
    finally:
        destroy()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "result.json").write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
