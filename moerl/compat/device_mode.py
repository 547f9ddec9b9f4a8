"""A torch function mode that maps CUDA device arguments to the CPU.

megatron-core creates some tensors with a literal ``device="cuda"`` (schedules'
token counters, optimizer scalars, gradient-buffer warm-ups) and calls
``tensor.cuda()`` on a few paths. Those are not ``torch.cuda`` functions we can
replace, so while CUDA is absent this mode rewrites them: a ``device`` that names
CUDA becomes the CPU, and ``Tensor.cuda()`` returns the tensor itself.

The distributed optimizer and ``Float16OptimizerWithFloat16Params`` also accept
only parameters whose ``tensor.type()`` string is ``torch.cuda.{Float,Half,
BFloat16}Tensor``; under this mode an argument-free ``type()`` reports the CUDA
name for CPU tensors. Nothing else is touched, and the mode is never entered
when CUDA is available.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

CPU = torch.device("cpu")


def is_cuda_device(device: Any) -> bool:
    """True for 'cuda', 'cuda:1', torch.device('cuda'), and bare ints (CUDA ordinals)."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class CudaToCpuMode(TorchFunctionMode):
    """Redirect CUDA placements to the CPU (see module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if ".cuda." not in name else name
        if "device" in kwargs and is_cuda_device(kwargs["device"]):
            kwargs = {**kwargs, "device": CPU}
        if func is torch.Tensor.to and len(args) > 1 and is_cuda_device(args[1]):
            args = (args[0], CPU, *args[2:])
        return func(*args, **kwargs)


_mode: CudaToCpuMode | None = None


def enter() -> None:
    """Enter the mode for the rest of this thread's life (idempotent)."""
    global _mode
    if _mode is None:
        _mode = CudaToCpuMode()
        _mode.__enter__()


def exit_() -> None:
    global _mode
    if _mode is not None:
        _mode.__exit__(None, None, None)
        _mode = None


def active() -> bool:
    return _mode is not None


def _on_this_thread() -> bool:
    """Whether the mode is on this thread's torch function mode stack."""
    return _mode is not None and any(m is _mode for m in _get_current_function_mode_stack())


def everywhere() -> bool:
    """MOERL_CPU_MODE_EVERYWHERE=1: never suspend the mode (a debugging escape hatch)."""
    return os.environ.get("MOERL_CPU_MODE_EVERYWHERE", "") not in ("", "0")


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """The block runs without the mode when the mode is this thread's innermost one
    (otherwise, or with ``everywhere()``, the block runs as it would have)."""
    stack = _get_current_function_mode_stack()
    if _mode is None or not stack or stack[-1] is not _mode or everywhere():
        yield
        return
    _mode.__exit__(None, None, None)
    try:
        yield
    finally:
        _mode.__enter__()


@contextlib.contextmanager
def resumed() -> Iterator[None]:
    """The block runs with the mode (entered for it if ``suspended()`` took it off)."""
    if _mode is None or _on_this_thread():
        yield
        return
    _mode.__enter__()
    try:
        yield
    finally:
        _mode.__exit__(None, None, None)
