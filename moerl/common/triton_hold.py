"""Keep Triton out of processes that cannot run it.

Triton's kernels run on a GPU, or on the CPU under its interpreter (``TRITON_INTERPRET=1``).
Yet megatron-core (``megatron.core.utils``) and torch's compiler stack, which
transformers' masking utilities import, load Triton whenever it is installed. That maps
libtriton into the process: about 70 MB of resident memory in every trainer rank and
every embedded engine of a CPU run, used for nothing. :func:`hold_back` installs an
import hook that makes ``import triton`` raise ``ModuleNotFoundError`` in this process
when CUDA is absent. The libraries then take the path they take on a machine without
Triton (megatron's ``HAVE_TRITON = False``; torch's ``has_triton()`` is already False
without a GPU). moerl's kernels choose their torch twins on the CPU anyway.

The hook checks at each import, so setting ``TRITON_INTERPRET=1`` (the kernel tests do)
lets Triton load as usual. It does nothing where Triton is already imported. Its callers
install it only where CUDA is absent: the CPU layer (``moerl.compat.activate``) and the
engine's entry point (``moerl.device.has_cuda``).
"""

from __future__ import annotations

import importlib.abc
import os
import sys
from collections.abc import Sequence
from types import ModuleType

__all__ = ["hold_back", "is_held_back", "release"]

REASON = (
    "triton is held back in this CPU-only process (it runs only on a GPU or under its "
    "interpreter; moerl/common/triton_hold.py): set TRITON_INTERPRET=1 before start-up "
    "to load it"
)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


class _Hold(importlib.abc.MetaPathFinder):
    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> None:
        if name.partition(".")[0] == "triton" and not _interpreting():
            raise ModuleNotFoundError(REASON, name=name)
        return None


_hook: _Hold | None = None


def hold_back() -> bool:
    """Install the hook (call it only where CUDA is absent) unless this process has
    imported Triton already; returns whether the hook is installed (idempotent)."""
    global _hook
    if _hook is not None:
        return True
    if "triton" in sys.modules:
        return False
    _hook = _Hold()
    sys.meta_path.insert(0, _hook)
    return True


def is_held_back() -> bool:
    """True while the hook keeps ``import triton`` from loading it."""
    return _hook is not None and not _interpreting()


def release() -> None:
    """Remove the hook (tests)."""
    global _hook
    if _hook is not None:
        sys.meta_path.remove(_hook)
        _hook = None
