"""Run a function on N local processes joined in one gloo/NCCL group.

For tools and tests on one machine; clusters use torchrun, which sets the same
environment variables.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def single_process_world(backend: str | None = None) -> None:
    """Make this process a world of one rank (megatron-core needs its groups even then):
    for benchmarks and tools that build a model in-process."""
    from moerl.parallel.state import init_process_group

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        LOCAL_WORLD_SIZE="1",
    )
    init_process_group(backend=backend)


def _entry(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    port: int,
    threads: int,
    args: tuple[Any, ...],
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(threads)
    from moerl.parallel.state import destroy, init_process_group

    init_process_group()
    try:
        fn(*args)
    finally:
        destroy()


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, threads: int | None = None) -> None:
    """Call ``fn(*args)`` on ranks 0..world_size-1; re-raise the first child failure.

    ``fn`` must be importable (defined at module level in a package), since children
    are started with the ``spawn`` method.
    """
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // world_size)
    mp.start_processes(
        _entry,
        args=(fn, world_size, free_port(), threads, args),
        nprocs=world_size,
        join=True,
        start_method="spawn",
    )
