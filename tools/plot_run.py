"""Plot a run directory: reward, staleness, mismatch decomposition, timeline.

    python tools/plot_run.py RUN_DIR [--out DIR]

Reads ``RUN_DIR/metrics.jsonl`` and ``RUN_DIR/timeline.*.jsonl`` and writes
``reward.png``, ``staleness.png``, ``mismatch.png`` and ``timeline.png`` into ``--out``
(default: RUN_DIR), printing each path written; a plot whose data the run did not
record is skipped with a message on stderr. The plotting lives in
``moerl.telemetry.plots`` (key conventions documented there) so benchmarks reuse it.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory with metrics.jsonl")
    parser.add_argument("--out", metavar="DIR", help="where to write the PNGs (default: RUN_DIR)")
    args = parser.parse_args(argv)

    from moerl.telemetry.plots import plot_run

    try:
        written = plot_run(args.run_dir, args.out, log=lambda msg: print(msg, file=sys.stderr))
    except FileNotFoundError as e:
        print(f"plot_run: {e}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
