"""The one place moerl asks which device and which collective backend to use.

Everything else calls these helpers, so CPU (gloo) and GPU (NCCL) runs share code
paths (STYLE.md item 12). On CPU, ``moerl.compat.activate()`` makes
megatron-core's own ``torch.cuda`` calls safe.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from moerl.common.checks import DEVICE_NAMES, check_device_name  # noqa: F401 (re-exported)

T = TypeVar("T")


def has_cuda() -> bool:
    return torch.cuda.is_available()


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def device() -> torch.device:
    """This process's compute device: its local GPU when CUDA is present, else the CPU."""
    if has_cuda():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def resolve(name: str, key: str = "--device") -> torch.device:
    """The device ``name`` means on this machine: 'auto' is this process's GPU when CUDA is
    present, else the CPU; 'cuda' and 'cuda:N' must exist (ValueError naming ``key`` and
    the fix otherwise)."""
    check_device_name(key, name)
    if name == "auto":
        return device()
    if name == "cpu":
        return torch.device("cpu")
    if not has_cuda():
        raise ValueError(
            f"{key} {name}: torch {torch.__version__} sees no CUDA device on this machine "
            f"(CUDA build: {torch.version.cuda or 'none'}); use {key} cpu (or auto), or run "
            "on a GPU machine with a CUDA build of torch"
        )
    index = int(name.partition(":")[2] or torch.cuda.current_device())
    count = torch.cuda.device_count()
    if index >= count:
        raise ValueError(
            f"{key} {name}: this machine has {count} CUDA device(s), cuda:0..cuda:{count - 1}; "
            "choose one of them (CUDA_VISIBLE_DEVICES renumbers them from 0)"
        )
    return torch.device("cuda", index)


def synchronize_device(dev: torch.device) -> None:
    """Wait for the work queued on ``dev`` (no-op on the CPU), for timing."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def all_reduce_host(tensor: torch.Tensor, op: Any = None, group: Any = None) -> torch.Tensor:
    """``tensor`` (on the CPU) all-reduced over ``group`` (``op`` default: sum), through
    this process's device, since NCCL reduces device tensors only; the result is on the
    CPU."""
    import torch.distributed as dist

    on = tensor.to(device())
    dist.all_reduce(on, op=dist.ReduceOp.SUM if op is None else op, group=group)
    return on.cpu()


def default_backend() -> str:
    return "nccl" if has_cuda() else "gloo"


def bind_local_device() -> torch.device:
    """Pin this process to its local GPU (no-op on CPU) and return its device."""
    if has_cuda():
        torch.cuda.set_device(local_rank() % torch.cuda.device_count())
    return device()


def synchronize() -> None:
    if has_cuda():
        torch.cuda.synchronize()


def name() -> str:
    """'cuda: <GPU name>' for this process's GPU, or 'cpu' (for benchmark records)."""
    return f"cuda: {torch.cuda.get_device_name(device())}" if has_cuda() else "cpu"


def cuda_time_and_peak(fn: Callable[[], None], reps: int) -> tuple[float, float]:
    """Median milliseconds of ``fn`` over ``reps`` runs (CUDA events, after one warm-up
    run) and the MiB its one more run allocates beyond what was live before."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return statistics.median(times), (torch.cuda.max_memory_allocated() - before) / 2**20


def graphed(fn: Callable[[], T], dev: torch.device, warmup: int = 2) -> Callable[[], T]:
    """``fn`` captured as a CUDA graph on ``dev``: run ``warmup`` times on a side stream
    first (lazy initialisation, cuBLAS workspaces), then captured once. The returned
    callable replays it and returns what the captured call returned: the same tensors,
    refilled by every replay, and it keeps ``fn`` (with every tensor its closure holds)
    alive. ``fn`` must read its inputs from tensors that stay put (copy new inputs into
    them) and must not wait on the host. Only this thread is held
    to the capture's rules (another thread, a colocated trainer, may use the GPU)."""
    with torch.cuda.device(dev):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            out = fn()

    def replay() -> T:
        graph.replay()
        return out

    # The graph reads by address whatever fn's closure made before the capture (index
    # tensors, input buffers): it must live as long as the graph, or its memory is reused
    # and a replay reads garbage (an H200 run: "index out of bounds" in the first replay).
    replay.keeps = (graph, fn)  # type: ignore[attr-defined]
    return replay


def empty_cache() -> None:
    if has_cuda():
        torch.cuda.empty_cache()
