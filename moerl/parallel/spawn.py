"""Run a function on N local processes joined in one gloo/NCCL group.

For the launcher, tools and tests on one machine; clusters use torchrun, which sets the
same environment variables. Every rank dies with the process that spawned it, however
that process dies (``die_with_parent``), and a failed rank leaves no error file in /tmp.

How a rank starts (``start_method``): with a CUDA (or ROCm) build of torch, as a fresh
interpreter (multiprocessing's ``spawn``), which never shares a CUDA context. With a
CPU-only build on Linux, forked from multiprocessing's forkserver, a server process
that imported torch and megatron-core once (``moerl.parallel.preload``): each rank then
starts in milliseconds instead of importing for 3–6 s of CPU (a 4-rank world on 2
cores: six to ten seconds of wall time before its first collective). A forked rank
gets what a fresh one would have had from its spawner at the moment it starts:
multiprocessing hands it the spawner's working directory, ``sys.path`` and main module;
``spawn`` adds its environment and its stdout/stderr (the server's are those of the
moment it started).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
from collections.abc import Callable
from multiprocessing import reduction
from typing import Any

import torch
import torch.multiprocessing as mp

from moerl.common.children import die_with, die_with_parent, free_port

__all__ = [
    "die_with_parent",
    "free_port",
    "run_here",
    "single_process_world",
    "spawn",
    "start_method",
    "stop_ranks",
]

PRELOAD = "moerl.parallel.preload"
"""The module the forkserver imports before it forks ranks."""


def start_method() -> str:
    """'forkserver' with a CPU-only torch build on Linux, 'spawn' otherwise (the module
    docstring says why)."""
    gpu_build = torch.version.cuda is not None or getattr(torch.version, "hip", None)
    return "forkserver" if sys.platform == "linux" and not gpu_build else "spawn"


class _Stdio:
    """The spawner's stdout and stderr, sent to a forked rank as descriptors of its own
    (multiprocessing duplicates them into the rank while it starts)."""

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _received, (reduction.DupFd(1), reduction.DupFd(2))


def _received(*dup_fds: Any) -> tuple[int, ...]:
    return tuple(dup.detach() for dup in dup_fds)


def _adopt(env: dict[str, str], stdio: tuple[int, ...]) -> None:
    """A forked rank takes its spawner's environment and stdout/stderr."""
    os.environ.clear()
    os.environ.update(env)
    for fd, target in zip(stdio, (1, 2), strict=True):
        os.dup2(fd, target)
        os.close(fd)


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
    inherited: tuple[dict[str, str], tuple[int, ...]] | None = None,
) -> None:
    """A rank of the world ``parent`` (the spawner's pid) started. ``inherited``: the
    spawner's environment and stdout/stderr, for a rank the forkserver forked; that
    rank dies with the spawner by a watch of its own (the server lives while any
    process it forked does, so its exit cannot be what ends them) and with the server."""
    if inherited is not None:
        _adopt(*inherited)
        die_with(parent)
        die_with_parent(os.getppid())
    else:
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

    ``fn`` and ``args`` must pickle, and ``fn`` be importable (defined at module level
    in a package): a rank unpickles them, started by ``start_method()``.
    """
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // world_size)
    method = start_method()
    inherited = None
    if method == "forkserver":
        # once per process, before the server starts (a server already running keeps
        # what it was given)
        multiprocessing.set_forkserver_preload([PRELOAD])
        inherited = (dict(os.environ), _Stdio())
    context = mp.start_processes(
        _entry,
        args=(fn, world_size, free_port(), threads, os.getpid(), args, inherited),
        nprocs=world_size,
        join=False,
        start_method=method,
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
