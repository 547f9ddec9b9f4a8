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
    parser.add_argument("--family", required=True, choices=tiny_families())
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = save_tiny_checkpoint(tiny_config(args.family), args.out, seed=args.seed)
    print(f"wrote {args.family} tiny checkpoint to {path}")


if __name__ == "__main__":
    main()
