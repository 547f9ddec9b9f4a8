"""Train/inference mismatch on one fixed rollout set, decomposed: Keep Routing replay on/off
× sampling mask on/off.

    python tools/bench/mismatch.py [--quick] [--prompts 32] [--new-tokens 48]
                                   [--dtype bfloat16] [--out DIR]

What ``tools/check_replay.py`` does (its ``run``): a tiny random checkpoint; rollouts
generated once by the embedded engine in ``--dtype`` (bf16 by default: the numerics a
real engine has), routes and sampling masks recorded; the same weights loaded into
megatron-core (``--trainer-dtype``, fp32 by default) score the same tokens under the four
settings. Prints one line per setting

    replay=on|off mask=on|off flip_rate=… mismatch_k3=… mean_abs_dlogp=…

then ``reduction=R`` (k3 with replay and mask both off / both on; what the two remove)
and the decomposition (``mismatch_total=… routing=… sampling_mask=… staleness=…
numerics=…``). ``result.json`` keeps the four settings under ``settings``
("replay_on_mask_on", …) for a bar plot. ``--quick``: 6 prompts of 12 new tokens.

``--geometries qwen3_30b_router deepseek_v3_router`` (or ``all``) repeats the study at a
real router geometry (``moerl.checks.geometry``: Qwen3-30B-A3B's 128 experts top-8
softmax router; DeepSeek-V3's 256 experts top-8 sigmoid router with expert bias, 8 groups
top-4), small everywhere else, routers scaled to logit std ``--router-std`` over experts,
once per ``--engine-dtypes`` (bf16 and fp32 engines by default; the trainer stays fp32).
Per geometry it prints the router margin percentiles, the four settings with per-layer
flip rates, the decomposition and

    geometry=… engine=… flip_rate_off=… flip_rate_on=… k3_off=… k3_on=… reduction=…
        routing_share=…

(off: replay and mask off; on: both on; routing_share: the routing component's share of
k3_off), beside R3's published numbers (`R3`). ``result.json`` keeps them under
``geometries`` → name → engine dtype.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path
from typing import Any

TOOLS = Path(__file__).resolve().parents[1]


def _check_replay():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("check_replay", TOOLS / "check_replay.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


R3 = (
    "R3 (Ma et al. 2025, arXiv:2510.11370), Qwen3-30B-A3B, SGLang rollouts vs Megatron "
    "training: ~10% of router decisions differ (flip_rate_off ~0.10), k3 ~1.5e-3 without "
    "replay (6.4e-4 for dense Qwen3-8B)"
)
"""R3's published numbers, as cited, printed beside ours."""
R3_NUMBERS = {"model": "Qwen3-30B-A3B", "flip_rate_off": 0.10, "k3_off": 1.5e-3}


def key(replay: str, mask: str) -> str:
    return f"replay_{replay}_mask_{mask}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from moerl.models.registry import tiny_families

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="6 prompts of 12 new tokens")
    parser.add_argument("--family", default="deepseek_moe", choices=tiny_families())
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"),
                        help="engine dtype")  # fmt: skip
    parser.add_argument("--trainer-dtype", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--prompts", type=int, default=None, help="rollouts (default 32)")
    parser.add_argument("--new-tokens", type=int, default=None, help="max new tokens (48)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write result.json here")
    parser.add_argument(
        "--geometries",
        nargs="*",
        default=[],
        help="also at these router geometries (names or 'all')",
    )
    parser.add_argument(
        "--engine-dtypes",
        nargs="+",
        default=["bfloat16", "float32"],
        choices=("float32", "bfloat16"),
        help="engine dtypes per geometry",
    )
    parser.add_argument(
        "--router-std",
        type=float,
        default=1.5,
        help="router logit std over experts the geometries are scaled to",
    )
    args = parser.parse_args(argv)
    prompts = args.prompts or (6 if args.quick else 32)
    new_tokens = args.new_tokens or (12 if args.quick else 48)

    from moerl.checks.replay import SettingResult
    from moerl.telemetry.mismatch import Decomposition

    out = _check_replay().run(
        family=args.family, dtype=args.dtype, trainer_dtype=args.trainer_dtype,
        prompts=prompts, new_tokens=new_tokens, seed=args.seed,
    )  # fmt: skip
    settings = [SettingResult(**r) for r in out["settings"]]
    for r in settings:
        print(r.line(), flush=True)
    by = {(r.replay, r.mask): r for r in settings}
    replay_flips = max(by[("on", "on")].flip_rate, by[("on", "off")].flip_rate)
    result: dict[str, Any] = {
        "family": args.family,
        "engine_dtype": args.dtype,
        "trainer_dtype": args.trainer_dtype,
        "prompts": prompts,
        "new_tokens": new_tokens,
        "rollouts": out["rollouts"],
        "response_tokens": out["response_tokens"],
        "settings": {key(r.replay, r.mask): out["settings"][i] for i, r in enumerate(settings)},
        "reduction": out["reduction"],
        "decomposition": out["decomposition"],
        "replay_flip_rate": replay_flips,  # must be 0: a replayed forward keeps every route
    }
    print(f"reduction={out['reduction']:.2f} (k3 without replay and mask / with both; {out['rollouts']} rollouts, {out['response_tokens']} tokens, "
          f"engine {args.dtype}, trainer {args.trainer_dtype})", flush=True)  # fmt: skip
    if out["decomposition"]:
        print(Decomposition(**out["decomposition"]).line(), flush=True)
    if replay_flips > 0:
        print(f"WARNING: a replayed forward changed router decisions "
              f"(flip_rate={replay_flips:.4f})", flush=True)  # fmt: skip
    if args.geometries:
        result["geometries"] = geometries(args, prompts, new_tokens)
        result["r3"] = R3_NUMBERS
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def summary_line(name: str, engine: str, g: dict[str, Any]) -> str:
    return (
        f"geometry={name} engine={engine} flip_rate_off={g['flip_rate_off']:.4f} "
        f"flip_rate_on={g['flip_rate_on']:.4f} k3_off={g['k3_off']:.3e} k3_on={g['k3_on']:.3e} "
        f"reduction={g['reduction']:.2f} routing_share={g['routing_share']:.2f}"
    )


def geometries(args: argparse.Namespace, prompts: int, new_tokens: int) -> dict[str, Any]:
    """The study at each router geometry and engine dtype (trainer fp32)."""
    import tempfile

    from moerl.checks.geometry import GEOMETRIES, margin_line, save_geometry_checkpoint
    from moerl.checks.replay import SettingResult
    from moerl.telemetry.mismatch import Decomposition

    names = sorted(GEOMETRIES) if args.geometries == ["all"] else args.geometries
    out: dict[str, Any] = {}
    print(R3, flush=True)
    for name in names:
        with tempfile.TemporaryDirectory(prefix=f"moerl-{name}-") as tmp:
            ckpt = save_geometry_checkpoint(name, Path(tmp), seed=args.seed,
                                            router_std=args.router_std)  # fmt: skip
            print(margin_line(name, ckpt.margins), flush=True)
            out[name] = {"router_std": args.router_std, "router_factors": ckpt.router_factors,
                         "margins": ckpt.margins}  # fmt: skip
            for engine in args.engine_dtypes:
                run = _check_replay().run(
                    family=ckpt.model.family, dtype=engine, trainer_dtype="fp32",
                    prompts=prompts, new_tokens=new_tokens, seed=args.seed, hf_dir=ckpt.path,
                )  # fmt: skip
                by = {(r["replay"], r["mask"]): r for r in run["settings"]}
                for r in run["settings"]:
                    layers = ",".join(f"{x:.4f}" for x in r["flip_rate_per_layer"])
                    print(f"  {SettingResult(**r).line()} per_layer={layers}", flush=True)
                parts = run["decomposition"] or {}
                if parts:
                    print("  " + Decomposition(**parts).line(), flush=True)
                off, on = by[("off", "off")], by[("on", "on")]
                g = {
                    "flip_rate_off": off["flip_rate"],
                    "flip_rate_on": max(on["flip_rate"], by[("on", "off")]["flip_rate"]),
                    "flip_rate_per_layer_off": off["flip_rate_per_layer"],
                    "k3_off": off["mismatch_k3"],
                    "k3_on": on["mismatch_k3"],
                    "reduction": run["reduction"],
                    "routing_share": parts.get("routing", float("nan"))
                    / max(parts.get("total", float("nan")), 1e-30),
                    "decomposition": parts,
                    "settings": {key(r["replay"], r["mask"]): r for r in run["settings"]},
                    "response_tokens": run["response_tokens"],
                }
                out[name][engine] = g
                print(summary_line(name, engine, g), flush=True)
    return out


if __name__ == "__main__":
    main()
