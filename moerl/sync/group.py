"""A process group between trainer rank 0 and the engines, beside any other group.

The trainer already has its default (megatron) group, and SGLang servers have
their own; weight sync needs a separate group spanning trainer rank 0 and every
engine. Like SGLang's ``init_custom_process_group``, this builds a gloo or NCCL
group on its own TCP store without touching the default group. Rank 0 (the
trainer) hosts the store.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


def init_custom_process_group(
    backend: str,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    timeout_s: float = 300.0,
) -> dist.ProcessGroup:
    """Join a new ``backend`` group of ``world_size`` ranks as ``rank``."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r}: choose 'gloo' or 'nccl'")
    store = dist.TCPStore(
        master_address,
        int(master_port),
        world_size,
        is_master=rank == 0,
        timeout=timedelta(seconds=timeout_s),
    )
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timedelta(seconds=timeout_s))
    return dist.ProcessGroupNCCL(store, rank, world_size)


def broadcast(group: dist.ProcessGroup, tensor: torch.Tensor, src: int = 0) -> None:
    """Broadcast ``tensor`` in place from ``src`` over a group made here (blocking)."""
    group.broadcast(tensor, src).wait()
