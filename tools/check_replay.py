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
from dataclasses import asdict
from pathlib import Path
from typing import Any

from moerl.models.registry import tiny_families


def run(
    *,
    family: str = "deepseek_moe",
    dtype: str = "bfloat16",
    trainer_dtype: str = "fp32",
    layout: str = "single",
    prompts: int = 16,
    new_tokens: int = 32,
    rollouts: str | Path | None = None,
    hf_dir: str | Path | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Generate (or load) rollouts and score them under the four settings. Returns
    ``settings`` (one dict per setting, ``SettingResult`` fields), ``reduction`` (k3
    without replay and mask / with both), ``decomposition`` (or None), ``rollouts`` and
    ``response_tokens`` (None when the rollouts were given)."""
    from moerl.checks.replay import collect_rollouts, decomposition, score
    from moerl.models.hf_tiny import save_tiny_checkpoint
    from moerl.models.tiny import tiny_config

    count = tokens = None
    with tempfile.TemporaryDirectory(prefix="moerl-replay-") as tmp:
        work = Path(tmp)
        hf = (
            Path(hf_dir)
            if hf_dir
            else save_tiny_checkpoint(tiny_config(family), work / "hf", seed=seed)
        )
        path = Path(rollouts) if rollouts else work / "rollouts.jsonl"
        if not rollouts:
            trajs = collect_rollouts(
                hf,
                path,
                num_prompts=prompts,
                max_new_tokens=new_tokens,
                dtype=dtype,
                seed=seed,
            )
            count, tokens = len(trajs), sum(t.response_len for t in trajs)
            print(f"{count} rollouts, {tokens} response tokens, engine dtype {dtype}", flush=True)
        results = score(layout, hf, path, work / "scores.json", dtype=trainer_dtype)
        parts = decomposition(work / "scores.json")
    by = {(r.replay, r.mask): r for r in results}
    both, neither = by[("on", "on")], by[("off", "off")]
    return {
        "settings": [asdict(r) for r in results],
        "reduction": neither.mismatch_k3 / max(both.mismatch_k3, 1e-30),
        "decomposition": parts,
        "rollouts": count,
        "response_tokens": tokens,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="deepseek_moe", choices=tiny_families())
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

    from moerl.checks.replay import SettingResult
    from moerl.telemetry.mismatch import Decomposition

    out = run(
        family=args.family,
        dtype=args.dtype,
        trainer_dtype=args.trainer_dtype,
        layout=args.layout,
        prompts=args.prompts,
        new_tokens=args.new_tokens,
        rollouts=args.rollouts,
        hf_dir=args.hf_dir,
        seed=args.seed,
    )
    results = [SettingResult(**r) for r in out["settings"]]
    for r in results:
        print(r.line(), flush=True)
    by = {(r.replay, r.mask): r for r in results}
    print(f"reduction={out['reduction']:.1f}", flush=True)
    if out["decomposition"]:
        print(Decomposition(**out["decomposition"]).line(), flush=True)
    if by[("on", "on")].flip_rate > 0 or by[("on", "off")].flip_rate > 0:
        print("FAIL: a replayed forward changed a router decision", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
