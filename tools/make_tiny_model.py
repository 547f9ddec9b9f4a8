"""Write a tiny random HF checkpoint of a model family (no download).

    python tools/make_tiny_model.py --family qwen3_moe --out /tmp/tiny-qwen3

The checkpoint is built with transformers' own classes (Qwen3MoeForCausalLM,
DeepseekV3ForCausalLM) and saved with save_pretrained, so it has the same names
and layout as a real Hugging Face checkpoint, plus a built-in char-level tokenizer.
"""

from __future__ import annotations

import argparse

from moerl.models.hf_tiny import save_tiny_checkpoint
from moerl.models.registry import tiny_families
from moerl.models.tiny import tiny_config


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--family",
        required=True,
        help=f"{', '.join(tiny_families())} or the import path of a ModelFamily with a tiny config",
    )
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        model = tiny_config(args.family)
    except ValueError as err:
        parser.error(str(err))
    path = save_tiny_checkpoint(model, args.out, seed=args.seed)
    print(f"wrote {args.family} tiny checkpoint to {path}")


if __name__ == "__main__":
    main()
