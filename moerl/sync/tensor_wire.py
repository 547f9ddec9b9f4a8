"""Trainer rank 0's side of the same-host weight path (``sync.transport=tensor``).

No bytes go through a socket: each bucket is gathered into a staging buffer in shared
memory (CPU, torch's ``file_system`` strategy, which a process that did not fork from
this one can open; on CUDA a device buffer the engines open by IPC handle), and one
``/update_weights_from_tensor`` per engine carries handles to its tensors: views of that
buffer at their byte offsets, as SGLang's ``(name, tensor)`` list (``load_format`` null),
which SGLang and moerl's engine both load. The engines copy the values into their models
before they answer, so a buffer is written again only after every engine answered the
bucket it held: :meth:`TensorWire.send` returns once bucket k is posted, having waited for
bucket k-1's answer, so the engines load bucket k while the caller gathers bucket k+1 into
the other staging buffer. Tensors the engines can open where they lie are not gathered at
all (``TensorWire.borrow``): CPU tensors in shared memory, as the trainer's parameters are once
:func:`share_parameters` moved them there, so a push of an unconverted model copies its
bytes once, in the engine. An engine inside this process (``launcher.placement=colocated``)
gets in-process handles instead (moerl/engine/weights/tensor_payload.py says why) and can borrow
any tensor. Same interface as :class:`moerl.sync.wire.Wire`.
"""

from __future__ import annotations

import concurrent.futures
import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from moerl.engine.inprocess import is_inprocess_url
from moerl.engine.weights.bucket import dtype_of
from moerl.engine.weights.tensor_payload import serialize_named_tensors
from moerl.rollout.client import EngineClient
from moerl.sync.stream import Bucket, shared_in_memory
from moerl.sync.wire import RunCoro, WeightSyncError

log = logging.getLogger(__name__)


def share_cpu_tensors() -> None:
    """Share CPU tensors by file name: the engine, not a child of this process, cannot
    receive the file descriptors torch shares by default."""
    import torch.multiprocessing as tmp

    tmp.set_sharing_strategy("file_system")


def share_parameters(chunks: list[torch.nn.Module]) -> int:
    """Move the CPU parameters of ``chunks`` into shared memory (each storage once, in
    place: the optimizer and every view keep working on the same tensors), so the tensor
    path hands the engines handles to them instead of copies. Returns the bytes moved:
    none, with a warning, when they would not fit in /dev/shm (pushes then copy)."""
    storages: dict[int, torch.UntypedStorage] = {}
    for chunk in chunks:
        for param in chunk.parameters():
            if param.device.type == "cpu" and not param.is_shared():
                storage = param.untyped_storage()
                storages.setdefault(storage.data_ptr(), storage)
    need = sum(s.nbytes() for s in storages.values())
    free = _shm_free()
    if need and free is not None and need > free - SHM_RESERVE:
        # a full /dev/shm fails a write with SIGBUS: keep them private, pushes copy
        log.warning(
            "sync.transport=tensor: the parameters (%.0f MB) do not fit in /dev/shm (%.0f MB "
            "free), so every push copies them into shared buckets; a larger /dev/shm (docker "
            "--shm-size) lets the engines read them in place",
            need / 2**20,
            free / 2**20,
        )
        return 0
    for storage in storages.values():
        storage.share_memory_()
    return need


SHM_RESERVE = 512 * 2**20  # left free in /dev/shm for the staging buffers and others


def _shm_free() -> int | None:
    try:
        return shutil.disk_usage("/dev/shm").free
    except OSError:  # no /dev/shm (macOS): torch shares through files elsewhere
        return None


def all_in_process(client: EngineClient) -> bool:
    """Whether every engine of ``client`` runs inside this process (colocated placement),
    where IPC cannot reach it and handles are in-process ones."""
    return all(is_inprocess_url(url) for url in client.urls)


@dataclass
class _Posted:
    what: str
    bucket: Bucket
    views: list[tuple[str, torch.Tensor]]  # alive until the engines answered
    http: concurrent.futures.Future[Any]


class TensorWire:
    """Posts buckets to the engines as tensor handles; one per push."""

    def __init__(
        self,
        client: EngineClient,
        run: RunCoro,
        *,
        tp_sizes: dict[str, int],
        timeout_s: float,
        flush_cache: bool,
    ) -> None:
        self.client, self._run = client, run
        self.tp_sizes, self.timeout_s, self.flush_cache = tp_sizes, timeout_s, flush_cache
        self.broken = False  # no group to fall out of step: a failed push leaves none behind
        self.stats = {"bytes": 0, "buckets": 0, "tensors": 0, "borrowed_bytes": 0}
        self._posted: _Posted | None = None
        self._sent = 0
        # colocated placement has one engine, in this process; IPC cannot reach it
        self.in_process = all_in_process(client)
        # what a push may hand over as it is (``bucketize``'s borrow): any tensor to an
        # engine in this process, those in shared memory to engines in other processes
        self.borrow: Callable[[torch.Tensor], bool] = (
            (lambda tensor: True) if self.in_process else shared_in_memory
        )

    def send(self, bucket: Bucket, version: int | None) -> None:
        """Post ``bucket`` once the engines answered the one before; its bytes are free
        again at the next ``send`` (or ``finish``)."""
        if self._posted is not None:
            posted, self._posted = self._posted, None
            self._answered(posted)
        self._sent += 1
        what = f"bucket {self._sent} ({len(bucket.names)} tensors from {bucket.names[0]})"
        views = _views(bucket, shared=not self.in_process)
        http = self._run(
            self.client.update_weights_from_tensor(
                partial(serialize_named_tensors, views, in_process=self.in_process),
                tp_sizes=self.tp_sizes,
                flush_cache=version is not None and self.flush_cache,
                weight_version=None if version is None else str(version),
            )
        )
        self._posted = _Posted(what, bucket, views, http)

    def finish(self) -> dict[str, int]:
        """Wait for the engines to load the last bucket; returns the totals."""
        posted, self._posted = self._posted, None
        if posted is not None:
            self._answered(posted)
        return self.stats

    def abandon(self) -> None:
        """After an error: wait (bounded) for what is posted, so no engine still reads a
        buffer the next push writes."""
        if self._posted is not None:
            concurrent.futures.wait([self._posted.http], timeout=self.timeout_s)
        self._posted = None

    def _answered(self, posted: _Posted) -> None:
        try:
            posted.http.result(timeout=self.timeout_s)
        except Exception as err:
            raise WeightSyncError(f"engines rejected {posted.what}: {err}") from err
        self.stats["bytes"] += posted.bucket.nbytes
        if posted.bucket.tensors is not None:  # read where they lie, not gathered
            self.stats["borrowed_bytes"] += posted.bucket.nbytes
        self.stats["buckets"] += 1
        self.stats["tensors"] += len(posted.bucket.names)


def _views(bucket: Bucket, shared: bool = True) -> list[tuple[str, torch.Tensor]]:
    """The bucket's tensors as views of its bytes, in shared memory with ``shared`` (a
    tensor whose offset its dtype cannot view at gets a copy of its own); a borrowed
    bucket's tensors as they are."""
    if bucket.tensors is not None:
        return list(zip(bucket.names, bucket.tensors))
    flat = bucket.flattened()
    shared = shared and flat.device.type == "cpu"
    if shared and not flat.is_shared():  # a lone tensor's own bytes
        flat = flat.clone().share_memory_()
    out, offset = [], 0
    for name, dtype_name, shape in zip(bucket.names, bucket.dtypes, bucket.shapes):
        dtype = dtype_of(dtype_name)
        size = torch.Size(shape).numel() * dtype.itemsize
        piece = flat[offset : offset + size]
        if offset % dtype.itemsize:
            piece = piece.clone()
            if shared:
                piece.share_memory_()
        out.append((name, piece.view(dtype).view(shape)))
        offset += size
    if offset != flat.numel():
        raise WeightSyncError(f"bucket of {bucket.names[0]}: {flat.numel()} bytes for {offset}")
    return out
