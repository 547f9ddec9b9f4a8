"""megatron-core's ``@jit_fuser`` without importing torch's compiler at import time.

``megatron.core.jit`` sets ``jit_fuser = torch.compile`` and some forty fused functions
are decorated with it while ``megatron.core`` imports. ``torch.compile(fn)`` compiles
nothing until ``fn`` is first called, but it imports ``torch._dynamo`` and inductor
(sympy, the inductor's passes) right away: 1.7 s of every process that imports
megatron-core (each trainer rank, each test worker), whether or not a fused function
ever runs. :func:`install` makes ``megatron.core.jit.jit_fuser`` a decorator that calls
``torch.compile`` on the function's first call instead, with the same arguments, so what
runs (compiled where megatron compiles) is unchanged; only the import moves to the first
use. It touches nothing when megatron-core is already imported or its ``jit_fuser`` is
not ``torch.compile`` (older torch: ``torch.jit.script``).

:func:`set_eager` (the CPU layer, ``moerl.compat``, which also switches dynamo off) runs
every deferred function as written and never calls ``torch.compile``: with dynamo off a
compiled function runs eagerly anyway, but ``torch.compile`` itself imports inductor on
its first call (seconds, at the first router forward of every trainer rank).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

__all__ = ["defer", "install", "set_eager"]

_MODULE = "megatron.core.jit"
_eager = False


def set_eager(eager: bool) -> bool:
    """Run deferred functions uncompiled (True) or compile them on first call (False, the
    default); returns the previous setting."""
    global _eager
    previous, _eager = _eager, bool(eager)
    return previous


def defer(compile_fn: Callable[..., Any]) -> Callable[..., Any]:
    """A decorator like ``compile_fn`` (``torch.compile``: ``@c``, ``@c(**options)`` or
    ``c(fn, **options)``) that calls ``compile_fn(fn, **options)`` on ``fn``'s first call."""

    def decorator(fn: Callable[..., Any] | None = None, **options: Any) -> Any:
        if fn is None:  # @jit_fuser(mode=...)
            return lambda f: decorator(f, **options)
        compiled: Callable[..., Any] | None = None

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            nonlocal compiled
            if _eager:
                return fn(*args, **kwargs)
            if compiled is None:
                compiled = compile_fn(fn, **options)
            return compiled(*args, **kwargs)

        call.__moerl_deferred__ = True  # type: ignore[attr-defined]
        return call

    return decorator


class _Finder(importlib.abc.MetaPathFinder):
    """Finds ``megatron.core.jit`` as usual and swaps its ``jit_fuser`` once it has run."""

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name != _MODULE:
            return None
        uninstall()
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            import torch

            if getattr(module, "jit_fuser", None) is torch.compile:
                module.jit_fuser = defer(torch.compile)  # type: ignore[attr-defined]

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> bool:
    """Defer megatron-core's ``torch.compile`` decorations (before megatron-core is
    imported; idempotent). False when megatron-core's jit module is already loaded."""
    if _MODULE in sys.modules:
        return False
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    return True


def uninstall() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Finder)]
