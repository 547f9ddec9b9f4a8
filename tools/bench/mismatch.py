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
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
