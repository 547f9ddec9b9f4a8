"""``python -m moerl.engine --model-path DIR --port P``: the embedded inference engine.

Flags are named as SGLang's (``--model-path``, ``--port``, ``--host``,
``--max-running-requests``, ``--enable-return-routed-experts``, ``--enable-lora``,
``--api-key``), so scripts move between the two by changing the module.
"""

from __future__ import annotations

import argparse
import logging

from moerl.engine.launch import build_state


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m moerl.engine", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=True, help="local HF checkpoint directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--enable-return-routed-experts", action="store_true")
    p.add_argument("--enable-lora", action="store_true")
    p.add_argument("--max-lora-rank", type=int, default=64)
    p.add_argument("--max-loras-per-batch", type=int, default=8)
    p.add_argument("--lora-target-modules", nargs="*", default=None, help="e.g. q_proj o_proj")
    p.add_argument("--api-key", default=None)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--random-seed", type=int, default=0)
    p.add_argument("--weight-version", default="0", help="initial weight version")
    p.add_argument("--num-threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--log-level", default="warning")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper())
    app = build_state(args)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
