"""Which implementation a ``moerl.kernels`` call runs: the Triton kernel or its torch twin.

``backend``:

- ``auto`` (default): Triton when it is importable and the inputs live on a CUDA device;
  the torch twin otherwise (CPU runs, no Triton).
- ``triton``: always the kernel; on CPU tensors only under ``TRITON_INTERPRET=1``
  (Triton's interpreter, set by the tests before anything imports triton); a clear
  error when it cannot run here.
- ``torch``: always the twin (debugging, or a kernel suspected of a bug).

Set it with ``set_backend`` (the trainer does, from ``trainer.kernels``), or the
environment variable ``MOERL_KERNELS`` before start-up.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

import torch

from moerl.common import triton_hold

BACKENDS = ("auto", "triton", "torch")
_backend = os.environ.get("MOERL_KERNELS", "auto")


def set_backend(name: str) -> None:
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"kernels backend {name!r}: choose one of {BACKENDS}")
    _backend = name


def get_backend() -> str:
    return _backend


@contextlib.contextmanager
def backend(name: str) -> Iterator[None]:
    """Run a block under another backend (tests, benchmarks)."""
    previous = _backend
    set_backend(name)
    try:
        yield
    finally:
        set_backend(previous)


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when this call should run the Triton kernel on ``tensors``."""
    if _backend not in BACKENDS:
        raise ValueError(f"MOERL_KERNELS={_backend!r}: choose one of {BACKENDS}")
    if _backend == "torch":
        return False
    on_gpu = all(t.is_cuda for t in tensors)
    if _backend == "auto":
        return on_gpu and triton_available()
    runnable = triton_available() and (on_gpu or interpreting())
    if not runnable:
        why = (
            "triton is not installed (pip install 'moerl[kernels]')"
            if not triton_available() and not triton_hold.is_held_back()
            else "the inputs are on the CPU; set TRITON_INTERPRET=1 to run Triton's interpreter"
        )
        raise RuntimeError(f"kernels backend 'triton' cannot run here: {why}")
    return runnable
