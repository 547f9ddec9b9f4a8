"""Check HF ⇄ Megatron conversion of a model family under parallel layouts.

Builds a tiny random HF checkpoint with transformers' own model class, loads it into
megatron-core under each layout, and compares fp32 logits on the same tokens with
transformers' forward; then streams the export back to HF names and compares every
tensor with the checkpoint bit for bit.

    python tools/check_conversion.py --family deepseek_moe --layouts single,tp2,ep2,pp2

Prints ``family=F layout=L max_logit_abs_diff=X roundtrip=exact|DIFF`` per layout and
exits non-zero when a logit difference exceeds 1e-4 or a round trip is not exact.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from moerl.checks.conversion import LOGIT_TOL, check_layout, prepare
from moerl.models import family_names, get_family
from moerl.models.hf_tiny import save_tiny_checkpoint
from moerl.models.tiny import tiny_config
from moerl.parallel.layout import parse_layout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--family",
        required=True,
        help=f"{', '.join(family_names())} or the import path of a ModelFamily",
    )
    parser.add_argument("--layouts", default="single,tp2,ep2,pp2")
    parser.add_argument("--hf-dir", help="use this HF checkpoint instead of a tiny random one")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    for name in layouts:
        parse_layout(name)
    try:
        get_family(args.family)
    except ValueError as err:
        parser.error(str(err))
    failed = []
    with tempfile.TemporaryDirectory(prefix="moerl-conv-") as workdir:
        if args.hf_dir:
            hf_dir = Path(args.hf_dir)
            from moerl.convert import HFCheckpoint

            vocab = get_family(args.family).from_hf(HFCheckpoint(hf_dir).config()).vocab_size
        else:
            model = tiny_config(args.family)
            hf_dir = save_tiny_checkpoint(model, Path(workdir) / "hf", seed=args.seed)
            vocab = model.vocab_size
        prepare(hf_dir, workdir, vocab)
        print(f"{args.family}: {hf_dir} (logit tolerance {LOGIT_TOL:g}, fp32)", flush=True)
        for name in layouts:
            start = time.perf_counter()
            result = check_layout(args.family, name, hf_dir, workdir)
            print(f"{result.line()} ({time.perf_counter() - start:.1f}s)", flush=True)
            if not result.ok:
                failed.append(name)
    if failed:
        print(f"FAILED layouts: {','.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
