"""megatron-core's RNG tracker on the CPU generator.

``megatron.core.tensor_parallel.random`` saves and restores "CUDA" RNG states
through private helpers built on ``torch.cuda._lazy_call``. Without CUDA,
``_lazy_call`` silently queues the callback for a CUDA initialisation that never
happens, so a fork of the tracker would never restore the generator. We point
those helpers at the CPU default generator instead; together with the
``torch.cuda`` RNG stand-ins this gives the tracker (model-parallel, data-parallel
and expert-parallel streams) the same semantics on CPU as on GPU.
"""

from __future__ import annotations

from typing import Any

import torch

_originals: dict[str, Any] = {}


def _get_cpu_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False):
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False):
    torch.set_rng_state(new_state)


def install() -> None:
    from megatron.core.tensor_parallel import random as mcore_random

    for name, fn in (
        ("_get_cuda_rng_state", _get_cpu_rng_state),
        ("_set_cuda_rng_state", _set_cpu_rng_state),
    ):
        if name not in _originals:
            _originals[name] = getattr(mcore_random, name)
        setattr(mcore_random, name, fn)


def uninstall() -> None:
    from megatron.core.tensor_parallel import random as mcore_random

    for name, fn in _originals.items():
        setattr(mcore_random, name, fn)
    _originals.clear()
