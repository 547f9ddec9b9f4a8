"""``python -m moerl.engine --model-path DIR --port P``: the embedded inference engine
(its flags: moerl/engine/cli.py). SIGTERM or Ctrl-C fails the requests in flight (503)
and exits.
"""

from __future__ import annotations

import argparse
import errno
import gc
import json
import logging
import os
import socket
import sys
from typing import Any

from moerl.engine import DEFAULT_HOST, DEFAULT_PORT


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
    order: before it, the process has loaded no model and written nothing (its port is
    bound, not listened on: ``bind_port``)."""
    from moerl.engine.launch import preload

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


def bind_port(host: str, port: int) -> socket.socket:
    """The engine's listening socket, bound now and listened on once the model is
    loaded, so the port is this engine's from its start: a port the launcher picked for
    it cannot be taken while the model loads, and a client asking before then is
    refused at once. Bound without SO_REUSEADDR first, which no other socket can share
    (two that both set it may, while neither listens); with it where only connections
    of an engine before this one still linger there (TIME_WAIT), as uvicorn binds.
    Exits with the fix where the port is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for reuse in (False, True):
        sock = socket.socket(family, socket.SOCK_STREAM)
        if reuse:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            return sock
        except OSError as err:
            sock.close()
            if err.errno != errno.EADDRINUSE or reuse:
                fix = (
                    "another process holds it; choose another --port or stop that process"
                    if err.errno == errno.EADDRINUSE
                    else "check --host and --port"
                )
                raise SystemExit(
                    f"moerl.engine: cannot listen on {host}:{port} ({err.strerror}): {fix}"
                ) from err
    raise AssertionError("unreachable")


class _Lenient(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # the full parse reports it
        raise ValueError(message)


def _bind_early(argv: list[str] | None) -> tuple[socket.socket, tuple[str, int]] | None:
    """The port ``--host`` and ``--port`` name, bound before the imports (the flags' full
    parser imports torch), with that address; None for ``--help``, for flags this cannot
    read, or where the bind fails (``main`` binds after the full parse, which then says
    what is wrong)."""
    pre = _Lenient(add_help=False, allow_abbrev=False)
    pre.add_argument("-h", "--help", action="store_true")
    pre.add_argument("--host", default=DEFAULT_HOST)
    pre.add_argument("--port", type=int, default=DEFAULT_PORT)
    try:
        known, _ = pre.parse_known_args(argv)
        if known.help:
            return None
        return bind_port(known.host, known.port), (known.host, known.port)
    except (ValueError, SystemExit):
        return None


def main(argv: list[str] | None = None) -> None:
    early = _bind_early(argv)  # the port is this engine's at once
    import uvicorn

    from moerl.common.gc_freeze import freeze_gc
    from moerl.engine.cli import parse_args
    from moerl.engine.launch import build_state

    args = parse_args(argv)
    if early is not None and early[1] == (args.host, args.port):
        sock = early[0]
    else:
        if early is not None:
            early[0].close()
        sock = bind_port(args.host, args.port)

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
    # shared with SO_REUSEADDR from now on, as uvicorn's own socket is: the connections it
    # accepts inherit it, so an engine restarted on this port can bind it while the
    # connections of one killed still linger there. Listened on at once: no socket that
    # merely binds can share it then.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
