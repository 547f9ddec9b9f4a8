"""Run a function on N local processes joined in one gloo/NCCL group.

For tools and tests on one machine; clusters use torchrun, which sets the same
environment variables. Every rank dies with the process that spawned it, however that
process dies (``die_with_parent``), and a failed rank leaves no error file in /tmp.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from moerl.common.children import die_with_parent, free_port

__all__ = [
    "die_with_parent",
    "free_port",
    "run_here",
    "single_process_world",
    "spawn",
    "stop_ranks",
]


def stop_ranks(processes: list[Any], grace_s: float = 10.0) -> None:
    """SIGTERM every live rank, then SIGKILL what still runs after ``grace_s``: a SIGINT
    sent to the launcher alone (``kill -INT``) does not reach its ranks, and
    multiprocessing would wait at exit for ranks that go on training."""
    live = [p for p in processes if p.is_alive()]
    for proc in live:
        proc.terminate()
    for proc in live:
        proc.join(grace_s)
        if proc.is_alive():
            proc.kill()
            proc.join()


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


def run_here(
    fn: Callable[..., Any], *args: Any, threads: int | None = None, backend: str | None = None
) -> None:
    """Call ``fn(*args)`` as the only rank of a world of one, in this process (no child
    to start, import torch again and join)."""
    from moerl.parallel.state import destroy

    if threads:
        torch.set_num_threads(threads)
    single_process_world(backend)
    try:
        fn(*args)
    finally:
        destroy()


def _entry(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    port: int,
    threads: int,
    parent: int,
    args: tuple[Any, ...],
) -> None:
    die_with_parent(parent)
    _keep_fds_from_grandchildren()
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


def _keep_fds_from_grandchildren() -> None:
    """Mark every inherited descriptor but stdin/out/err close-on-exec. The spawn start
    method hands a rank the write end of the pipe its parent waits on (the sentinel), and a
    helper that a library starts with fork+exec without closing descriptors (torch's
    torch_shm_manager, once a CPU tensor is shared by file name) would hold it: the parent
    then waits for the helper, not the rank, and hangs after the rank has exited."""
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:  # no /proc: nothing to do portably
        return
    for fd in fds:
        if fd > 2:
            with contextlib.suppress(OSError):
                os.set_inheritable(fd, False)


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, threads: int | None = None) -> None:
    """Call ``fn(*args)`` on ranks 0..world_size-1; re-raise the first child failure.

    ``fn`` must be importable (defined at module level in a package), since children
    are started with the ``spawn`` method.
    """
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // world_size)
    context = mp.start_processes(
        _entry,
        args=(fn, world_size, free_port(), threads, os.getpid(), args),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    try:
        while not context.join():
            pass
    except BaseException:  # Ctrl-C / SIGINT here, or a failed rank: no rank runs on
        stop_ranks(context.processes)
        raise
    finally:
        # torch passes a failed rank's traceback through /tmp/pytorch-errorfile-*.pickle
        # and leaves the file there; the exception raised above already carries it
        for name in context.error_files:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name)
