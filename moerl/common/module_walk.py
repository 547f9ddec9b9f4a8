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

import weakref

import torch

__all__ = ["modules_of"]

_generation = 0
"""Submodule registrations seen since import, in every module."""


def _registered(module: torch.nn.Module, name: str, submodule: object) -> None:
    global _generation
    _generation += 1


torch.nn.modules.module.register_module_module_registration_hook(_registered)

# root → (generation at the walk, the walk, its modules' direct-submodule counts summed)
_kept: weakref.WeakKeyDictionary[torch.nn.Module, tuple[int, list[torch.nn.Module], int]] = (
    weakref.WeakKeyDictionary()
)


def _children_total(modules: list[torch.nn.Module]) -> int:
    return sum(len(m._modules) for m in modules)


def modules_of(root: torch.nn.Module) -> list[torch.nn.Module]:
    """``list(root.modules())``, from the last walk when the tree is unchanged (module
    docstring). The list is shared: do not modify it."""
    kept = _kept.get(root)
    if kept is not None:
        generation, modules, total = kept
        if generation == _generation and _children_total(modules) == total:
            return modules
    modules = list(root.modules())
    _kept[root] = (_generation, modules, _children_total(modules))
    return modules
