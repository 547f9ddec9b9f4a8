"""Weight buckets inside the trainer: pack an HF-named stream, and move one pipeline
stage's buckets to global rank 0.

Every rank of a stage iterates ``export_hf`` in lockstep; the stage's lowest global
rank (its *lead*) packs the tensors into buckets and, unless it is rank 0, sends them
to rank 0 point-to-point over the default group, one bucket at a time: a header
(int64 length), the JSON metadata (``names``, ``dtypes``, ``shapes``, ``last``) as
bytes, then the flat bucket. Memory stays bounded by one bucket on either side.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from moerl.engine.bucket import dtype_name, empty_bucket, flatten


@dataclass
class Bucket:
    """Tensors bound for one ``flattened_bucket`` broadcast, in order."""

    names: list[str] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)
    nbytes: int = 0
    flat: torch.Tensor | None = None  # set instead of ``tensors`` when received flat

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.names.append(name)
        self.dtypes.append(dtype_name(tensor.dtype))
        self.shapes.append(list(tensor.shape))
        self.tensors.append(tensor.detach())
        self.nbytes += tensor.numel() * tensor.element_size()

    def flattened(self) -> torch.Tensor:
        if self.flat is not None:
            return self.flat
        if len(self.tensors) == 1:  # a lone (large) tensor: its bytes, without a copy
            return self.tensors[0].contiguous().reshape(-1).view(torch.uint8)
        return flatten(self.tensors)

    def meta(self, last: bool) -> dict[str, Any]:
        return {"names": self.names, "dtypes": self.dtypes, "shapes": self.shapes, "last": last}


def bucketize(
    stream: Iterable[tuple[str, torch.Tensor]], limit_bytes: int, dtype: torch.dtype | None
) -> Iterator[tuple[Bucket, bool]]:
    """``(bucket, is_last)`` of at most ``limit_bytes`` each (a bigger tensor goes alone),
    cast to ``dtype`` when given. The last bucket may be empty. Holds one bucket."""
    current = Bucket()
    for name, tensor in stream:
        if dtype is not None and tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        size = tensor.numel() * tensor.element_size()
        if current.names and current.nbytes + size > limit_bytes:
            yield current, False
            current = Bucket()
        current.add(name, tensor)
    yield current, True


def p2p_device() -> torch.device:
    """Where point-to-point tensors over the default group live (NCCL needs the GPU)."""
    from moerl import device

    return device.device() if dist.get_backend() == "nccl" else torch.device("cpu")


def stage_leads() -> dict[int, int]:
    """Collective: pipeline stage -> its lowest global rank. ``{0: 0}`` without dist."""
    if not dist.is_initialized():
        return {0: 0}
    from megatron.core import parallel_state

    stage = parallel_state.get_pipeline_model_parallel_rank()
    stages: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(stages, stage)
    leads: dict[int, int] = {}
    for rank, s in enumerate(stages):
        leads.setdefault(int(s), rank)
    assert leads[int(stages[0])] == 0, f"global rank 0 must lead its stage: {leads}"
    return leads


def send_bucket(bucket: Bucket, last: bool, dst: int = 0) -> None:
    """Send one bucket (possibly empty, to mark the end) to ``dst``; blocks until taken."""
    dev = p2p_device()
    raw = json.dumps(bucket.meta(last)).encode()
    meta = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    dist.send(torch.tensor([meta.numel()], dtype=torch.int64, device=dev), dst=dst)
    dist.send(meta.to(dev), dst=dst)
    if bucket.names:
        dist.send(bucket.flattened().to(dev), dst=dst)


def receive_buckets(src: int) -> Iterator[tuple[Bucket, bool]]:
    """``(bucket, is_last)`` sent by ``src`` with ``send_bucket``, up to its last."""
    dev = p2p_device()
    while True:
        size = torch.empty(1, dtype=torch.int64, device=dev)
        dist.recv(size, src=src)
        raw = torch.empty(int(size.item()), dtype=torch.uint8, device=dev)
        dist.recv(raw, src=src)
        meta = json.loads(bytes(raw.cpu().numpy()).decode())
        bucket = Bucket(meta["names"], meta["dtypes"], meta["shapes"])
        if bucket.names:
            bucket.flat = empty_bucket(bucket.dtypes, bucket.shapes, device=str(dev))
            dist.recv(bucket.flat, src=src)
            bucket.nbytes = bucket.flat.numel()
        yield bucket, bool(meta["last"])
        if meta["last"]:
            return
