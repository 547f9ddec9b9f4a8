"""``python -m moerl.engine --model-path DIR --port P``: the embedded inference engine
(its flags: moerl/engine/cli.py). SIGTERM or Ctrl-C fails the requests in flight (503)
and exits.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import sys
from typing import Any

from moerl.common.gc_freeze import freeze_gc
from moerl.engine.cli import parse_args
from moerl.engine.launch import build_state, preload


def read_order(line: str) -> dict[str, Any] | None:
    """``--await-start``'s order: {"log": file, "env": the variables to set (optional:
    the API key, ``MOERL_API_KEY``, among them)}; None for an empty line (end of input); ValueError for
    a malformed one."""
    if not line.strip():
        return None
    order = json.loads(line)
    if not isinstance(order, dict) or not isinstance(order.get("log"), str):
        raise ValueError(f"--await-start: the order needs its log file; got {line[:200]!r}")
    if not isinstance(order.get("env", {}), dict):
        raise ValueError(f"--await-start: the order's env must be an object; got {line[:200]!r}")
    return order


def await_start() -> bool:
    """``--await-start``: import what the engine needs (``launch.PRELOADED``), then wait
    for the order on stdin; from it on, stdout and stderr go to its log and its ``env``
    is set (the variables read only after this, the API key among them:
    moerl/engine/process.py ``LATE_ENV``). False (exit quietly) for no
    order: before it, the process has loaded no model, opened no port and written
    nothing."""
    preload()
    order = read_order(sys.stdin.readline())
    if order is None:
        return False
    fd = os.open(order["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.update({str(k): str(v) for k, v in order.get("env", {}).items()})
    return True


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    args = parse_args(argv)
    gc.disable()  # no full collections over the imports and the model while they load
    logging.basicConfig(level=args.log_level.upper())
    from moerl.config.threads import keep_freed_memory

    keep_freed_memory(args.malloc_keep_mb)  # before the model's allocations
    from moerl.common import triton_hold
    from moerl.device import has_cuda

    # transformers imports torch's compiler, which imports Triton: 70 MB for nothing
    # without a GPU (a CPU engine never compiles)
    if not has_cuda():
        triton_hold.hold_back()
    from moerl._version import shadowing

    if (shadow := shadowing()) is not None:
        logging.getLogger("moerl.engine").warning(shadow)
    if args.num_threads:  # its own process: every thread's ops (the scheduler's sets it too)
        import torch

        torch.set_num_threads(args.num_threads)
    if args.await_start and not await_start():
        return
    app = build_state(args)
    # what loaded lives as long as the engine: out of the collector's scans from here on
    # (moerl/common/gc_freeze.py; SGLang's /freeze_gc does the same on request)
    freeze_gc()
    gc.enable()
    scheduler = app.state.engine.scheduler

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            # Stop the scheduler first: requests in flight get a 503 instead of holding
            # the graceful shutdown open (a paused engine would never finish them).
            scheduler.stop("the engine is shutting down")
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=10,
    )
    Server(config).run()


if __name__ == "__main__":
    main()
