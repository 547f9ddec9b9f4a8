"""Keep Routing and sampling-mask replay: how much train/inference mismatch they remove.

    python tools/check_replay.py --family deepseek_moe [--dtype bfloat16] [--layout single]

Builds a tiny model, generates rollouts with the embedded engine (routes and sampling
masks recorded), loads the same weights into megatron-core, and scores the rollouts
with replay on/off × mask on/off. Prints one line per setting
``replay=on|off mask=on|off flip_rate=X mismatch_k3=Y mean_abs_dlogp=Z`` and then
``reduction=R`` (k3 mismatch without replay and mask / with both). Exits non-zero if a
replayed forward flipped any router decision.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from moerl.models.tiny import TINY


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="deepseek_moe", choices=sorted(TINY))
    parser.add_argument(
        "--dtype", default="bfloat16", choices=("float32", "bfloat16"), help="engine dtype"
    )
    parser.add_argument("--trainer-dtype", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--layout", default="single")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rollouts", help="score these rollouts (jsonl) instead of generating")
    parser.add_argument("--hf-dir", help="model checkpoint (default: a tiny random one)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from moerl.models.hf_tiny import save_tiny_checkpoint
    from moerl.models.tiny import tiny_config
    from moerl.telemetry.mismatch import Decomposition
    from moerl.trainer.replay_check import collect_rollouts, decomposition, score

    with tempfile.TemporaryDirectory(prefix="moerl-replay-") as tmp:
        work = Path(tmp)
        hf = (
            Path(args.hf_dir)
            if args.hf_dir
            else save_tiny_checkpoint(tiny_config(args.family), work / "hf", seed=args.seed)
        )
        rollouts = Path(args.rollouts) if args.rollouts else work / "rollouts.jsonl"
        if not args.rollouts:
            trajs = collect_rollouts(
                hf,
                rollouts,
                num_prompts=args.prompts,
                max_new_tokens=args.new_tokens,
                dtype=args.dtype,
                seed=args.seed,
            )
            tokens = sum(t.response_len for t in trajs)
            print(
                f"{len(trajs)} rollouts, {tokens} response tokens, engine dtype {args.dtype}",
                flush=True,
            )
        results = score(args.layout, hf, rollouts, work / "scores.json", dtype=args.trainer_dtype)
        parts = decomposition(work / "scores.json")
    for r in results:
        print(r.line(), flush=True)
    by = {(r.replay, r.mask): r for r in results}
    both, neither = by[("on", "on")], by[("off", "off")]
    reduction = neither.mismatch_k3 / max(both.mismatch_k3, 1e-30)
    print(f"reduction={reduction:.1f}", flush=True)
    if parts:
        print(Decomposition(**parts).line(), flush=True)
    if both.flip_rate > 0 or by[("on", "off")].flip_rate > 0:
        print("FAIL: a replayed forward changed a router decision", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
