"""A model's ``modules()``, walked once and kept while its module tree is unchanged.

``nn.Module.modules()`` is a recursive generator: each module it yields resumes one
generator frame per level above it. The trainer asks for a chunk's modules several
times a step (whether every module is in training mode; megatron-core's walk for the
routers after every backward), 2-3 ms of a tiny model's step for 170 modules.
:func:`modules_of` returns the list a walk would give, walked again only when the tree
may have changed:

- any module anywhere registered a submodule since the walk (torch's global module
  registration hook: ``setattr`` of a module, ``add_module``, ``ModuleList.append``,
  replacing a submodule by another), or
- a walked module's count of direct submodules differs from the walk's (a deletion, or
  a write straight into ``_modules`` as ``ModuleList.insert`` makes).

A submodule replaced by a direct ``_modules[name] = other`` write is the one change
neither sees; nothing in moerl or megatron-core does that to a built model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["derived", "modules_of"]

_generation = 0
"""Submodule registrations seen since import, in every module."""


def _registered(module: torch.nn.Module, name: str, submodule: object) -> None:
    global _generation
    _generation += 1


torch.nn.modules.module.register_module_module_registration_hook(_registered)


class _Walk:
    """A root's kept walk, stored on the root itself (so it lives and dies with the
    model): the generation it was walked at, its modules, their child counts summed,
    and what callers derived from it (:func:`derived`)."""

    __slots__ = ("generation", "modules", "total", "derived")

    def __init__(self, modules: list[torch.nn.Module]) -> None:
        self.generation, self.modules = _generation, modules
        self.total = _children_total(modules)
        self.derived: dict[str, Any] = {}


_ATTR = "_moerl_module_walk"


def _children_total(modules: list[torch.nn.Module]) -> int:
    return sum(len(m._modules) for m in modules)


def _walk(root: torch.nn.Module) -> _Walk:
    kept = root.__dict__.get(_ATTR)
    if kept is not None and kept.generation == _generation:
        if _children_total(kept.modules) == kept.total:
            return kept
    kept = _Walk(list(root.modules()))
    root.__dict__[_ATTR] = kept  # not nn.Module's setattr: no submodule, no hook
    return kept


def modules_of(root: torch.nn.Module) -> list[torch.nn.Module]:
    """``list(root.modules())``, from the last walk when the tree is unchanged (module
    docstring). The list is shared: do not modify it."""
    return _walk(root).modules


def derived(root: torch.nn.Module, key: str, fn: Callable[[list[torch.nn.Module]], Any]) -> Any:
    """``fn(modules_of(root))``, computed again only when the walk is."""
    kept = _walk(root)
    if key not in kept.derived:
        kept.derived[key] = fn(kept.modules)
    return kept.derived[key]
