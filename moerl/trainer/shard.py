"""Each data-parallel rank receives only its shard of a step's batch.

A step's batch is split in order into ``trainer.minibatches`` minibatches, and each
minibatch in order into one contiguous slice per data-parallel rank (what
``batch.split_for_rank`` and packing cut); a rank forwards and trains only on its
slices (:func:`owned_indices`). The whole of a trajectory — its routes
``[R, L, K]`` and its sampling mask, the bulk of a batch — goes only to the ranks that
own it. What the step computes over the whole batch (group advantages from the
rewards, π_old and the IS correction over every token, the mismatch metrics) needs only
the light per-token fields, so every rank gets every trajectory with those alone
(:func:`light`): token ids, logprobs, versions, reward, group.

Rank 0 holds the batch and scatters one list per rank (:class:`BatchScatter`): the
trajectories of its data-parallel shard whole, the others light, all in batch order, so
indices mean the same on every rank.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.distributed as dist

from moerl.common.trajectory import Trajectory


def owned_indices(num: int, minibatches: int, dp_size: int, dp_rank: int) -> list[int]:
    """Batch positions data-parallel rank ``dp_rank`` trains on: its contiguous slice of
    each minibatch."""
    if num % minibatches or (num // minibatches) % dp_size:
        raise ValueError(
            f"a batch of {num} trajectories does not split into trainer.minibatches="
            f"{minibatches} × data-parallel size {dp_size}"
        )
    per_mb = num // minibatches
    per_rank = per_mb // dp_size
    return [
        k * per_mb + dp_rank * per_rank + i for k in range(minibatches) for i in range(per_rank)
    ]


def light(t: Trajectory) -> Trajectory:
    """``t`` without its routes and sampling mask (what other ranks need of it)."""
    return dataclasses.replace(t, routed_experts=None, mask_ids=None, mask_offsets=None)


def shard_view(trajs: list[Trajectory], owned: list[int]) -> list[Trajectory]:
    """The batch as a rank owning ``owned`` sees it: those whole, the rest light."""
    mine = set(owned)
    return [t if i in mine else light(t) for i, t in enumerate(trajs)]


class BatchScatter:
    """Collective, built once on every rank after the parallel state exists: learns which
    data-parallel rank each process is. Calling it each step, rank 0 passes the step's
    batch and every rank (rank 0 too) gets its view (``shard_view`` of its
    data-parallel rank's ``owned_indices``); rank 0's ``None`` (no batch yet) reaches
    every rank as ``None``."""

    def __init__(self, minibatches: int) -> None:
        from megatron.core import parallel_state

        self.minibatches = minibatches
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.dp_of: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(self.dp_of, parallel_state.get_data_parallel_rank())

    def __call__(self, trajs: list[Trajectory] | None) -> list[Trajectory] | None:
        if len(self.dp_of) == 1:  # one process: nothing to send (pickling it cost ~2 ms)
            return trajs
        inputs: list[Any] | None = None
        if dist.get_rank() == 0:
            inputs = [None] * dist.get_world_size()
            if trajs is not None:
                views = {
                    r: shard_view(
                        trajs, owned_indices(len(trajs), self.minibatches, self.dp_size, r)
                    )
                    for r in range(self.dp_size)
                }
                inputs = [views[int(r)] for r in self.dp_of]
        out: list[Any] = [None]
        dist.scatter_object_list(out, inputs, src=0)
        return out[0]
