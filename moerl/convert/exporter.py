"""Stream megatron-core weights out as HF-named tensors, one tensor at a time.

``export_hf`` is a generator: for each Megatron tensor of this pipeline stage, in
a fixed order, it gathers the TP (or ETP) shards, and for routed experts it
assembles one expert at a time across the expert-parallel group, converts to HF
names and yields. Nothing is held beyond the tensor being yielded, so weight sync
can bucket and broadcast the stream without materialising the model on one rank.
Every rank of the stage must iterate it (it runs collectives); every rank gets the
same tensors and the caller decides which one sends them on.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from moerl.config.model import ModelConfig
from moerl.models.registry import get_family
from moerl.parallel.full_state import Shard, live_shards


def _assemble(pieces: list[Shard], shape: tuple[int, ...], group) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Gather ``pieces`` (this rank's parts of one tensor of ``shape``) from every
    rank of ``group`` and write them into a full tensor. A tensor held whole by the only
    rank of its group is returned as it is (a view of the parameter, read-only to the
    caller: weight sync copies it into its buckets; no copy here)."""
    world = dist.get_world_size(group) if group is not None else 1
    if world == 1 and len(pieces) == 1:
        whole = pieces[0]
        if tuple(whole.data.shape) == tuple(shape) and not any(whole.offset[whole.prepend :]):
            return whole.data.detach()
    if world == 1 and len(pieces) > 1:
        adjacent = _adjacent(pieces, shape)
        if adjacent is not None:
            return adjacent
    dtype = pieces[0].data.dtype if pieces else torch.float32
    meta = [(p.offset[p.prepend :], tuple(p.data.shape)) for p in pieces]
    flat = (
        torch.cat([p.data.detach().reshape(-1) for p in pieces])
        if pieces
        else torch.empty(0, dtype=dtype)
    )
    out = torch.empty(shape, dtype=dtype)
    if world == 1:
        metas, flats = [meta], [flat]
    else:
        metas = [meta] * world  # each rank's, written by all_gather_object
        dist.all_gather_object(metas, meta, group=group)
        sizes = [sum(int(torch.Size(s).numel()) for _, s in m) for m in metas]
        width = max(sizes)
        padded = torch.zeros(width, dtype=dtype)
        padded[: flat.numel()] = flat
        gathered = torch.empty(width * world, dtype=dtype)
        dist.all_gather_into_tensor(gathered, padded, group=group)
        flats = [gathered[r * width : r * width + sizes[r]] for r in range(world)]
    for rank_meta, rank_flat in zip(metas, flats):
        pos = 0
        for offset, local_shape in rank_meta:
            n = int(torch.Size(local_shape).numel())
            index = tuple(slice(o, o + s) for o, s in zip(offset, local_shape))
            out[index] = rank_flat[pos : pos + n].view(local_shape)
            pos += n
    return out


def _adjacent(pieces: list[Shard], shape: tuple[int, ...]) -> torch.Tensor | None:
    """The tensor ``pieces`` tile, as a view, when they lie end to end in one storage in
    its row-major order (a fused gate/up weight, which megatron-core's sharded state dict
    splits in two row blocks); None otherwise."""
    full = torch.Size(shape)
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    placed = []
    for p in pieces:
        data, offset = p.data.detach(), p.offset[p.prepend :]
        if not data.is_contiguous() or tuple(data.shape[1:]) != tuple(shape[1:]) or any(offset[1:]):
            return None  # not whole rows: not one run of the output's elements
        placed.append((offset[0] * strides[0], data))
    placed.sort(key=lambda item: item[0])
    first = placed[0][1]
    storage, size = first.untyped_storage().data_ptr(), first.element_size()
    expect = 0
    for start, data in placed:
        if start != expect or data.dtype != first.dtype:
            return None
        if data.untyped_storage().data_ptr() != storage:
            return None
        if data.data_ptr() != first.data_ptr() + start * size:
            return None
        expect += data.numel()
    if expect != full.numel():
        return None
    return first.as_strided(full, strides, first.storage_offset())


def _groups():  # type: ignore[no-untyped-def]
    if not dist.is_initialized():
        return None, None
    from megatron.core import parallel_state

    return (
        parallel_state.get_tensor_model_parallel_group(),
        parallel_state.get_expert_tensor_and_model_parallel_group(),
    )


def _to_hf(converter: Any, full: torch.Tensor, views: bool) -> list[torch.Tensor]:
    """``converter.to_hf``, asking for views where its signature takes ``views`` (a
    plugin family's converter may predate it)."""
    if views and _takes_views(converter.__class__):
        return list(converter.to_hf(full, views=True))
    return list(converter.to_hf(full))


@functools.cache
def _takes_views(cls: Any) -> bool:
    """Whether ``cls.to_hf`` accepts ``views`` (asked once per converter class, not per
    exported tensor)."""
    return "views" in inspect.signature(cls.to_hf).parameters


def export_hf(
    chunks: list[torch.nn.Module], model: ModelConfig, views: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every tensor this pipeline stage owns; ``views``:
    split ones may be views of one parameter (weight sync copies them; a checkpoint file
    may not hold tensors that share memory)."""
    fmap = get_family(model.family).weight_map(model)
    by_key: dict[str, list[Shard]] = {}
    for shard in live_shards(chunks):
        by_key.setdefault(shard.key, []).append(shard)
    dense_group, expert_group = _groups()
    for key, pieces in by_key.items():
        entry, layer = fmap.lookup(key)
        shape = pieces[0].global_shape
        if entry.expert:
            for expert in range(shape[0]):
                mine = [p for p in pieces if p.offset[0] == expert]
                full = _assemble(mine, shape[1:], expert_group)
                names = fmap.hf_names(entry, layer, expert)
                yield from zip(names, _to_hf(entry.converter, full, views))
                del full
        else:
            full = _assemble(pieces, shape, dense_group)
            names = fmap.hf_names(entry, layer)
            yield from zip(names, _to_hf(entry.converter, full, views))
            del full
