"""Check that every parallel layout trains exactly like one process.

For a tiny MoE model (4 layers: 1 dense + 3 MoE, 4 experts, top-2, a shared
expert, GQA) this runs the single-process reference and each requested layout
as its own gloo process group, starting from identical weights, and compares
the loss, every gradient (gathered back to full shape), the weights after one
Adam step, and the loss after that step.

    python tools/check_parallel.py --layouts tp2,pp2,ep2,etp2ep2,tp2ep2,tp2pp2,dp2ep2

Layout names: tokens tpN ppN epN etpN dpN (expert TP defaults to TP; dpN
replicates the whole grid). Exit status is non-zero when any layout FAILs.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

from moerl.checks.parity import (
    FP32_TOL,
    PARAM_TOL,
    ParityConfig,
    ParityResult,
    run_layout,
    run_reference,
)
from moerl.parallel.layout import parse_layout

DEFAULT_LAYOUTS = "tp2,pp2,ep2,etp2ep2,tp2ep2,tp2pp2,dp2ep2"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default=DEFAULT_LAYOUTS, help="comma-separated layouts")
    parser.add_argument(
        "--optimizer",
        choices=("distributed", "ddp"),
        default="distributed",
        help="megatron-core distributed optimizer (sharded state) or plain DDP + optimizer",
    )
    parser.add_argument(
        "--dispatcher",
        choices=("alltoall", "allgather"),
        default="alltoall",
        help="MoE token dispatcher",
    )
    parser.add_argument(
        "--replay",
        action="store_true",
        help="Keep Routing: every layout replays routes recorded by the reference model",
    )
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)

    layouts = [name.strip() for name in args.layouts.split(",") if name.strip()]
    for name in layouts:  # fail on a bad name or layout before starting any process
        pcfg, world = parse_layout(name)
        cfg = ParityConfig(seed=args.seed)
        pcfg.validate(
            world,
            num_layers=cfg.model.num_layers,
            num_attention_heads=cfg.model.num_attention_heads,
            num_query_groups=cfg.model.num_query_groups,
            num_experts=cfg.model.num_experts,
        )
    cfg = ParityConfig(
        seed=args.seed,
        use_distributed_optimizer=args.optimizer == "distributed",
        dispatcher=args.dispatcher,
        replay=args.replay,
    )
    print(
        f"tiny MoE: {cfg.model.num_layers} layers ({cfg.first_k_dense} dense), "
        f"{cfg.model.num_experts} experts top-{cfg.model.moe_router_topk} + shared expert; "
        f"global batch {cfg.global_batch} x {cfg.model.seq_length} tokens; "
        f"optimizer={args.optimizer}; dispatcher={args.dispatcher}; replay={args.replay}; fp32 tolerance {FP32_TOL:g} (relative L2 error, "
        "worst tensor)",
        flush=True,
    )
    print(
        f"param_rel_err compares the weights after one Adam step (eps={cfg.adam_eps:g}: with "
        "1e-8 every weight moves ~±lr however small its gradient, so last-bit sign "
        f"differences of near-zero gradients would move weights by 2·lr); bound {PARAM_TOL:g}.",
        flush=True,
    )
    results: list[ParityResult] = []
    with tempfile.TemporaryDirectory(prefix="moerl-parity-") as workdir:
        start = time.perf_counter()
        run_reference(workdir, cfg)
        print(f"reference (1 process): {time.perf_counter() - start:.1f}s", flush=True)
        for name in layouts:
            start = time.perf_counter()
            result = run_layout(name, workdir, cfg)
            results.append(result)
            print(f"{result.line()} ({time.perf_counter() - start:.1f}s)", flush=True)
    failed = [r.layout for r in results if not r.ok]
    if failed:
        print(f"FAILED layouts: {','.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
