"""CPU stand-ins for the ``torch.cuda`` calls megatron-core makes unconditionally.

On a CPU-only torch build these functions raise ("Torch not compiled with CUDA
enabled"). We replace exactly those functions, and only when CUDA is absent, with
CPU equivalents: the "current device" is the CPU, streams and events are no-ops
(CPU work is synchronous), and the "CUDA" RNG is the CPU default generator, so
megatron-core's RNG tracker forks and restores the generator CPU kernels use.

``torch.cuda.is_available()`` keeps returning False: libraries that branch on it
(transformers, our own device helpers) still see a CPU machine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

CPU = torch.device("cpu")


class CpuStream:
    """A do-nothing ``torch.cuda.Stream``: on CPU every op completes before it returns."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self.device = CPU
        self.priority = priority

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> CpuEvent:
        event = event or CpuEvent()
        event.record(self)
        return event

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CpuStream)

    def __hash__(self) -> int:
        return 0


class CpuEvent:
    """A ``torch.cuda.Event`` whose work is always complete; timing uses the wall clock."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, **kwargs: Any) -> None:
        self._t: float | None = None

    def record(self, stream: Any = None) -> None:
        import time

        self._t = time.perf_counter()

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: CpuEvent) -> float:
        if self._t is None or end._t is None:
            raise RuntimeError("both events must be recorded before elapsed_time()")
        return (end._t - self._t) * 1000.0


_STREAM = CpuStream()


def _stream_ctx(stream: Any = None) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


def _current_stream(device: Any = None) -> CpuStream:
    return _STREAM


def _default_stream(device: Any = None) -> CpuStream:
    return _STREAM


def _current_device() -> torch.device:
    return CPU


def _noop(name: str) -> Callable[..., None]:
    # A distinct function per name: torch._dynamo keys its trace rules on identity.
    def noop(*args: Any, **kwargs: Any) -> None:
        return None

    noop.__name__ = noop.__qualname__ = name
    return noop


def _zero(name: str) -> Callable[..., int]:
    def zero(*args: Any, **kwargs: Any) -> int:
        return 0

    zero.__name__ = zero.__qualname__ = name
    return zero


def _get_rng_state(device: Any = "cuda") -> torch.Tensor:
    return torch.get_rng_state()


def _set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
    torch.set_rng_state(new_state)


def _manual_seed(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


def _manual_seed_all(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


class _NvtxStub:
    """``torch.cuda.nvtx`` without CUDA: ranges are ignored."""

    @staticmethod
    def range_push(msg: str) -> int:
        return 0

    @staticmethod
    def range_pop() -> int:
        return 0

    @staticmethod
    def mark(msg: str) -> None:
        return None

    @staticmethod
    @contextlib.contextmanager
    def range(msg: str, *args: Any, **kwargs: Any):  # type: ignore[no-untyped-def]
        yield


# name in torch.cuda -> replacement. Only names that raise on a CPU-only build.
REPLACEMENTS: dict[str, Any] = {
    "current_device": _current_device,
    "set_device": _noop("set_device"),
    "synchronize": _noop("synchronize"),
    "empty_cache": _noop("empty_cache"),
    "Stream": CpuStream,
    "Event": CpuEvent,
    "stream": _stream_ctx,
    "current_stream": _current_stream,
    "default_stream": _default_stream,
    "get_rng_state": _get_rng_state,
    "set_rng_state": _set_rng_state,
    "manual_seed": _manual_seed,
    "manual_seed_all": _manual_seed_all,
    "memory_allocated": _zero("memory_allocated"),
    "max_memory_allocated": _zero("max_memory_allocated"),
    "memory_reserved": _zero("memory_reserved"),
    "max_memory_reserved": _zero("max_memory_reserved"),
    "reset_peak_memory_stats": _noop("reset_peak_memory_stats"),
    "nvtx": _NvtxStub,
}

_originals: dict[str, Any] = {}


def install() -> None:
    """Replace the raising ``torch.cuda`` functions with their CPU stand-ins (idempotent)."""
    for name, fn in REPLACEMENTS.items():
        if name not in _originals:
            _originals[name] = getattr(torch.cuda, name, None)
        setattr(torch.cuda, name, fn)


def uninstall() -> None:
    """Restore the original ``torch.cuda`` functions (used by tests)."""
    for name, fn in _originals.items():
        if fn is None:
            delattr(torch.cuda, name)
        else:
            setattr(torch.cuda, name, fn)
    _originals.clear()


def installed() -> bool:
    return bool(_originals)


def original(name: str) -> Callable[..., Any] | None:
    """The torch.cuda function that was replaced, for tests that check the patch is scoped."""
    return _originals.get(name)
