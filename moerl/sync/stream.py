"""Weight buckets inside the trainer: pack an HF-named stream, and move one pipeline
stage's buckets to global rank 0.

Every rank of a stage iterates ``export_hf`` in lockstep; the stage's lowest global
rank (its *lead*) packs the tensors into buckets and, unless it is rank 0, sends them
to rank 0 point-to-point over the default group, one bucket at a time: a header
(int64 length), the JSON metadata (``names``, ``dtypes``, ``shapes``, ``last``) as
bytes, then the flat bucket.

Tensors are copied (and cast) straight into one of two reused byte buffers
(:class:`Staging`), so a bucket costs one copy and no allocation; the buffers take turns,
so the next bucket is gathered into one while the other is on the wire. A bucket's bytes
stay valid until the bucket after next is gathered: its sender must be done with them by
then. Memory stays bounded by two buckets on either side.

The same-host tensor path can *borrow* instead (``bucketize``'s ``borrow``): a tensor the
engines can already open where it lies (in shared memory, as the trainer's parameters are
under ``sync.transport=tensor``) and that needs no cast is not copied; it goes, as itself,
into a bucket of borrowed tensors (``Bucket.tensors``) that is sent after the copied ones.
Such a bucket has no byte limit (it costs no memory) and its tensors must stay unchanged
until the engines answered, which a push guarantees: it returns only then.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from moerl.engine.weights.bucket import dtype_name, dtype_of


class Staging:
    """Two byte buffers of ``limit_bytes`` each on ``device``, handed out in turn and
    allocated on first use (then reused for every bucket of every push).

    ``hold``: instead, every bucket of a push gets a buffer of its own (the push's
    buckets all stay gathered, to be sent while the trainer steps on: sync.overlap);
    ``rewind()`` at the start of the next push hands them out again from the first."""

    def __init__(
        self,
        limit_bytes: int,
        device: torch.device | str = "cpu",
        shared: bool = False,
        hold: bool = False,
    ) -> None:
        """``shared``: CPU buffers in shared memory (the tensor path's engines map them)."""
        self.limit_bytes, self.device, self.shared = limit_bytes, torch.device(device), shared
        self.hold = hold
        self._buffers: list[torch.Tensor] = []
        self._turn = -1 if hold else 1

    def rewind(self) -> None:
        """A new push: hand out the buffers again from the first (``hold``)."""
        self._turn = -1 if self.hold else self._turn

    def next(self) -> torch.Tensor:
        """The buffer not handed out last time (whole; callers slice it); with ``hold``,
        the next one not handed out since ``rewind()``."""
        self._turn = self._turn + 1 if self.hold else self._turn ^ 1
        if len(self._buffers) == self._turn:
            if self.shared and self.device.type == "cpu":
                # allocated in shared memory, not copied there: pages are touched (and
                # counted) only as far as buckets fill them, as with torch.empty
                storage = torch.UntypedStorage._new_shared(self.limit_bytes)
                buffer = torch.empty(0, dtype=torch.uint8).set_(storage)
            else:
                buffer = torch.empty(self.limit_bytes, dtype=torch.uint8, device=self.device)
            self._buffers.append(buffer)
        return self._buffers[self._turn]


@dataclass
class Bucket:
    """Tensors bound for one ``flattened_bucket`` broadcast, in order; ``flat`` holds
    their bytes end to end (a view of a staging buffer, or a lone tensor's own bytes)."""

    names: list[str] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    nbytes: int = 0
    flat: torch.Tensor | None = None
    tensors: list[torch.Tensor] | None = None
    """Borrowed: the tensors themselves, no ``flat`` (the tensor path only)."""

    def describe(self, name: str, dtype: torch.dtype, shape: torch.Size) -> int:
        """Append one tensor's metadata; returns its byte offset in ``flat``."""
        offset = self.nbytes
        self.names.append(name)
        self.dtypes.append(dtype_name(dtype))
        self.shapes.append(list(shape))
        self.nbytes += shape.numel() * _itemsize(dtype)
        return offset

    def flattened(self) -> torch.Tensor:
        assert self.flat is not None, "an empty bucket has no bytes"
        return self.flat

    def meta(self, last: bool) -> dict[str, Any]:
        return {"names": self.names, "dtypes": self.dtypes, "shapes": self.shapes, "last": last}


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize  # no tensor made: this runs once per pushed tensor


def _on_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" for t in tensors)


def _copy_into(buffer: torch.Tensor, offset: int, tensor: torch.Tensor, dtype: torch.dtype) -> None:
    """Write ``tensor`` cast to ``dtype`` at byte ``offset`` of ``buffer``, in one copy."""
    size = tensor.numel() * _itemsize(dtype)
    dst = buffer[offset : offset + size]
    if _on_cpu(dst, tensor) and tensor.dtype == dtype and tensor.is_contiguous():
        # one thread's memcpy: a torch copy this large splits over the intra-op threads and
        # waits for the slowest, and with the broadcast's thread and the engines on the
        # same cores one of them is often descheduled (pushes 3-8x slower on 2 busy cores)
        np.copyto(dst.numpy(), tensor.reshape(-1).view(torch.uint8).numpy())
    elif offset % _itemsize(dtype) == 0:
        dst.view(dtype).view(tensor.shape).copy_(tensor)
    else:  # an odd offset cannot be viewed as ``dtype``: cast aside, copy the bytes
        dst.copy_(tensor.to(dtype).contiguous().reshape(-1).view(torch.uint8))


def shared_in_memory(tensor: torch.Tensor) -> bool:
    """A CPU tensor in shared memory: another process on this host can map it."""
    return tensor.device.type == "cpu" and tensor.is_shared()


def bucketize(
    stream: Iterable[tuple[str, torch.Tensor]],
    limit_bytes: int,
    dtype: torch.dtype | None,
    staging: Staging | None = None,
    borrow: Callable[[torch.Tensor], bool] | None = None,
    keep: Callable[[str], bool] | None = None,
) -> Iterator[tuple[Bucket, bool]]:
    """``(bucket, is_last)`` of at most ``limit_bytes`` each (a bigger tensor goes alone,
    as its own bytes), cast to ``dtype`` when given, gathered into ``staging`` (two
    buffers of its own when None). With ``borrow``, the tensors it accepts that need no
    cast are not copied: they follow, after the copied buckets, in one bucket of borrowed
    tensors (the module docstring). ``keep``: names sent in their own dtype whatever
    ``dtype`` says (what the engine keeps in float32, a router's weights). The last
    bucket may be empty."""
    staging = staging or Staging(limit_bytes)
    assert staging.limit_bytes >= limit_bytes, "staging buffers smaller than a bucket"
    current, buffer = Bucket(), None
    lent: list[torch.Tensor] = []
    borrowed = Bucket(tensors=lent)
    for name, tensor in stream:
        tensor = tensor.detach()
        target = tensor.dtype if dtype is None or (keep is not None and keep(name)) else dtype
        if borrow is not None and target == tensor.dtype and borrow(tensor):
            borrowed.describe(name, target, tensor.shape)
            lent.append(tensor)
            continue
        size = tensor.numel() * _itemsize(target)
        if current.names and current.nbytes + size > limit_bytes:
            yield current, False
            current, buffer = Bucket(), None
        offset = current.describe(name, target, tensor.shape)
        if size > limit_bytes:  # alone in its bucket (it was empty): no copy, unless held
            lone = tensor.to(target, copy=staging.hold).contiguous()
            current.flat = lone.reshape(-1).view(torch.uint8)
            continue
        if buffer is None:
            buffer = staging.next()
        _copy_into(buffer, offset, tensor, target)
        current.flat = buffer[: current.nbytes]
    if not borrowed.names:
        yield current, True
        return
    if current.names:
        yield current, False
    yield borrowed, True


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


def receive_buckets(src: int, staging: Staging) -> Iterator[tuple[Bucket, bool]]:
    """``(bucket, is_last)`` sent by ``src`` with ``send_bucket``, up to its last, each
    received into the next ``staging`` buffer (a lone tensor bigger than one, into a
    fresh tensor)."""
    dev = p2p_device()
    while True:
        size = torch.empty(1, dtype=torch.int64, device=dev)
        dist.recv(size, src=src)
        raw = torch.empty(int(size.item()), dtype=torch.uint8, device=dev)
        dist.recv(raw, src=src)
        meta = json.loads(bytes(raw.cpu().numpy()).decode())
        bucket = Bucket()
        for name, dtype, shape in zip(meta["names"], meta["dtypes"], meta["shapes"]):
            bucket.describe(name, dtype_of(dtype), torch.Size(shape))
        if bucket.names:
            if bucket.nbytes > staging.limit_bytes:
                bucket.flat = torch.empty(bucket.nbytes, dtype=torch.uint8, device=dev)
            else:
                bucket.flat = staging.next()[: bucket.nbytes]
            dist.recv(bucket.flat, src=src)
        yield bucket, bool(meta["last"])
        if meta["last"]:
            return
