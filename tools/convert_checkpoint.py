"""Convert between HF safetensors checkpoints and megatron-core distributed checkpoints.

    python tools/convert_checkpoint.py hf2mcore --hf-dir HF --out MCORE [--layout tp2ep2]
    python tools/convert_checkpoint.py mcore2hf --mcore-dir MCORE --out HF [--layout pp2]

MCORE is a directory hf2mcore wrote, a trainer checkpoint (`trainer.checkpoint_dir/step_N`)
or a trainer's checkpoint directory (its newest checkpoint): each carries the model
config and tokenizer the export needs.

The layout sets how many local processes do the work (a megatron-core checkpoint
can be saved in one layout and loaded in any other). On a cluster, run the same
functions under torchrun.
"""

from __future__ import annotations

import argparse

from moerl.convert.mcore_ckpt import hf_to_mcore, mcore_to_hf
from moerl.parallel import parse_layout, spawn


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("hf2mcore", help="HF safetensors → megatron-core distributed checkpoint")
    a.add_argument("--hf-dir", required=True)
    a.add_argument("--out", required=True)
    a.add_argument("--family", help="model family (default: from config.json model_type)")
    a.add_argument("--layout", default="single")
    b = sub.add_parser("mcore2hf", help="megatron-core distributed checkpoint → HF safetensors")
    b.add_argument("--mcore-dir", required=True)
    b.add_argument("--out", required=True)
    b.add_argument("--layout", default="single")
    b.add_argument(
        "--shard-mb", type=float, default=4096.0, help="max size of one safetensors file"
    )
    args = parser.parse_args(argv)
    _, world = parse_layout(args.layout)
    if args.cmd == "hf2mcore":
        spawn(hf_to_mcore, world, args.hf_dir, args.out, args.layout, args.family)
    else:
        spawn(mcore_to_hf, world, args.mcore_dir, args.out, args.layout, args.shard_mb)


if __name__ == "__main__":
    main()
