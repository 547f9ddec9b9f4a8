"""Full-shape tensors ⇄ any TP/PP/EP/ETP/DP layout, via megatron-core's sharded state dict.

Every megatron-core module describes each local tensor as a ``ShardedTensor``:
a layout-independent key, the global shape and this rank's offset in it (experts
are stacked along a prepended expert axis). That is enough to

- ``load_full``: write slices of full tensors into a model built for any layout, and
- ``gather_full``: reassemble full tensors (parameters or gradients) on rank 0,

so a parallel run can start from exactly the weights of a single-process run and
be compared with it tensor by tensor. This is a test and tooling path, not the
streaming HF export (``moerl.convert``), which never holds the full model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class Shard:
    """One local piece of a global tensor."""

    key: str
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]  # per global dim; prepended (expert) axes index a single entry
    prepend: int  # leading global dims the local tensor does not have
    data: torch.Tensor

    def index(self) -> tuple[slice | int, ...]:
        lead = tuple(self.offset[: self.prepend])
        rest = tuple(
            slice(off, off + size)
            for off, size in zip(self.offset[self.prepend :], self.data.shape, strict=True)
        )
        return lead + rest


def _flatten(tree: object) -> Iterator[object]:
    if isinstance(tree, dict):
        for value in tree.values():
            yield from _flatten(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from _flatten(value)
    else:
        yield tree


def local_shards(chunks: list[torch.nn.Module]) -> list[Shard]:
    """This rank's tensors of all model chunks (DDP wrappers are looked through), as
    ``Shard``s (extra states skipped)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    shards: list[Shard] = []
    for chunk in chunks:
        module: Any = getattr(chunk, "module", chunk)  # a megatron-core module (untyped)
        for item in _flatten(module.sharded_state_dict()):
            built = item.build() if isinstance(item, ShardedTensorFactory) else item
            for sh in _flatten(built):
                if not isinstance(sh, ShardedTensor):
                    continue  # ShardedObject: TE extra state, nothing numeric
                if sh.flattened_range is not None:
                    raise NotImplementedError(f"{sh.key}: flattened shards are not supported")
                shards.append(
                    Shard(
                        key=sh.key,
                        global_shape=tuple(sh.global_shape),
                        offset=tuple(sh.global_offset),
                        prepend=sh.prepend_axis_num,
                        data=sh.data,
                    )
                )
    return shards


_LAST: tuple[tuple[int, ...], list[Shard]] | None = None
"""The last model's shards by its parameters' addresses (one entry: an old model is not
kept alive longer than until the next one is asked about)."""


def live_tensors(chunks: list[torch.nn.Module]) -> list[torch.Tensor]:
    """Every parameter and buffer (the router's expert bias) of the chunks' modules, DDP
    looked through: the storages an export's tensors may be views of."""
    modules = [getattr(chunk, "module", chunk) for chunk in chunks]
    # nn.Module's own methods: megatron's DDP has a `buffers` list of its own
    return [t for m in modules for t in (*nn.Module.parameters(m), *nn.Module.buffers(m))]


def live_shards(chunks: list[torch.nn.Module]) -> list[Shard]:
    """``local_shards``, reused while it describes the live parameters: when every
    shard is a view of a parameter's or buffer's storage (an optimizer step, or the
    router's expert-bias update, writes into it), the list of the last call is returned
    as long as they all sit at the same addresses. Building the sharded state dict is
    most of a small model's export."""
    global _LAST
    params = live_tensors(chunks)
    key = tuple(p.data_ptr() for p in params)
    if _LAST is not None and _LAST[0] == key:
        return _LAST[1]
    shards = local_shards(chunks)
    storages = {p.untyped_storage().data_ptr() for p in params}
    if all(s.data.untyped_storage().data_ptr() in storages for s in shards):
        _LAST = (key, shards)
    return shards


@torch.no_grad()
def load_full(chunks: list[torch.nn.Module], full: dict[str, torch.Tensor]) -> int:
    """Copy this rank's slices of ``full`` into the model; returns the number of shards set.

    Raises KeyError naming any tensor the model has but ``full`` lacks, and
    ValueError on a global-shape mismatch.
    """
    shards = local_shards(chunks)
    missing = sorted({s.key for s in shards if s.key not in full})
    if missing:
        raise KeyError(f"full state lacks {len(missing)} tensors the model needs: {missing[:5]}")
    for s in shards:
        src = full[s.key]
        if tuple(src.shape) != s.global_shape:
            raise ValueError(
                f"{s.key}: full tensor has shape {tuple(src.shape)}, model expects {s.global_shape}"
            )
        s.data.copy_(src[s.index()])
    return len(shards)


def _grad_of(param: torch.nn.Parameter) -> torch.Tensor:
    grad = getattr(param, "main_grad", None)
    if grad is None:
        grad = param.grad
    if grad is None:
        return torch.zeros_like(param)
    return grad.view_as(param)


@contextlib.contextmanager
def _params_as_grads(chunks: list[torch.nn.Module]) -> Iterator[None]:
    """Temporarily point every parameter's data at its gradient, so the sharded state
    dict describes gradients with the parameters' keys and layout."""
    saved = []
    for chunk in chunks:
        for param in chunk.parameters():
            saved.append((param, param.data))
            param.data = _grad_of(param).detach()
    try:
        yield
    finally:
        for param, data in saved:
            param.data = data


@dataclass
class Gathered:
    tensors: dict[str, torch.Tensor]
    replica_max_abs_diff: float  # largest disagreement between copies of the same element
    uncovered: list[str]  # keys with elements no rank provided


def gather_full(
    chunks: list[torch.nn.Module], what: str = "param", dst: int = 0
) -> Gathered | None:
    """Reassemble full fp32 tensors on rank ``dst`` (None elsewhere).

    ``what`` is "param" or "grad" (``main_grad`` when megatron-core DDP wraps the
    model). Replicated copies (DP, TP-replicated norms, ...) are compared, and the
    largest disagreement is reported: after a correct gradient sync it is zero.
    """
    if what not in ("param", "grad"):
        raise ValueError(f"what={what!r}: choose 'param' or 'grad'")
    ctx = _params_as_grads(chunks) if what == "grad" else contextlib.nullcontext()
    with ctx:
        pieces = [
            (s.key, s.global_shape, s.offset, s.prepend, s.data.detach().float().cpu().clone())
            for s in local_shards(chunks)
        ]
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world > 1:
        everything: list | None = [None] * world if dist.get_rank() == dst else None
        dist.gather_object(pieces, everything, dst=dst)
        if dist.get_rank() != dst:
            return None
        all_pieces = [p for rank_pieces in everything for p in rank_pieces]  # type: ignore[union-attr]
    else:
        all_pieces = pieces

    tensors: dict[str, torch.Tensor] = {}
    written: dict[str, torch.Tensor] = {}
    worst = 0.0
    for key, shape, offset, prepend, data in all_pieces:
        if key not in tensors:
            tensors[key] = torch.zeros(shape, dtype=torch.float32)
            written[key] = torch.zeros(shape, dtype=torch.bool)
        idx = Shard(key, shape, offset, prepend, data).index()
        seen = written[key][idx]
        if seen.any():
            worst = max(worst, (tensors[key][idx][seen] - data[seen]).abs().max().item())
        tensors[key][idx] = data
        written[key][idx] = True
    uncovered = sorted(k for k, w in written.items() if not bool(w.all()))
    return Gathered(tensors=tensors, replica_max_abs_diff=worst, uncovered=uncovered)


def allgather_sharded_grads(ddp_chunks: list[Any]) -> None:
    """After the distributed optimizer's reduce-scatter, each DP rank holds only its
    shard of every gradient bucket; all-gather the shards so every ``main_grad`` is
    complete again (for checks and telemetry, not for training)."""
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    for chunk in ddp_chunks:
        for group in chunk.bucket_groups + chunk.expert_parallel_bucket_groups:
            if not group.ddp_config.use_distributed_optimizer:
                continue
            size = group.intra_distributed_optimizer_instance_size
            rank = group.intra_distributed_optimizer_instance_rank
            for bucket in group.buckets:
                local = shard_buffer(bucket.grad_data, size)[rank].clone()
                dist.all_gather_into_tensor(
                    bucket.grad_data, local, group=group.intra_distributed_optimizer_instance_group
                )
