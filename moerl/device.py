"""The one place moerl asks which device and which collective backend to use.

Everything else calls these helpers, so CPU (gloo) and GPU (NCCL) runs share code
paths (STYLE.md item 12). On CPU, ``moerl.compat.activate()`` makes
megatron-core's own ``torch.cuda`` calls safe.
"""

from __future__ import annotations

import os

import torch


def has_cuda() -> bool:
    return torch.cuda.is_available()


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def device() -> torch.device:
    """This process's compute device: its local GPU when CUDA is present, else the CPU."""
    if has_cuda():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


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
