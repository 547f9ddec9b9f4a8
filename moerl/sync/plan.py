"""A push of one rank's weights, recorded once and replayed without the export.

In a world of one rank every HF tensor ``export_hf(..., views=True)`` yields is a view
of a parameter (nothing is gathered, gate/up halves are slices), and every push packs
the same tensors into the same buckets at the same offsets. :class:`PushPlan` records
that layout on the first push (each tensor as ``(parameter, size, stride, storage
offset)`` and its place in its bucket) and later pushes copy the parameters straight
into the staging buffers, one ``torch._foreach_copy_`` per bucket: the tiny model's
130-tensor export and packing took ~3 ms of Python per push, the replay ~0.2 ms.

A plan is made only when every tensor is such a view, no bucket holds a lone tensor
larger than a bucket (those are sent from their own bytes), no offset is misaligned for
its dtype and nothing is borrowed (the same-host path); otherwise pushes export as
before. It holds only while the parameters keep their storage: each push checks the
storages' addresses and records again when one moved (a reloaded or resumed model).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from moerl.engine.weights.bucket import dtype_of, nbytes
from moerl.sync.stream import Bucket, Staging, bucketize


@dataclass(frozen=True)
class _Piece:
    """One bucket entry: a view of ``base``'s storage, copied at ``offset`` bytes."""

    base: torch.Tensor
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    offset: int

    def view(self) -> torch.Tensor:
        """The piece's values, a view that follows every in-place update of ``base``."""
        return self.base.detach().as_strided(self.size, self.stride, self.storage_offset)


@dataclass
class _PlannedBucket:
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    nbytes: int
    pieces: list[_Piece] = field(default_factory=list)


@dataclass
class _Copies:
    """One bucket's copies into one staging buffer, as views made once: the sources
    follow every in-place update of the parameters, so a replay is one
    ``_foreach_copy_`` (and a memcpy per large piece) with no torch call per piece. A
    call per piece let the rollout thread's event loop take the interpreter lock at
    each (a replay took 2-4 ms on a busy 2-core machine)."""

    dst: list[torch.Tensor]
    src: list[torch.Tensor]
    large: list[tuple[torch.Tensor, torch.Tensor]]  # contiguous, same dtype: one memcpy each
    across: list[tuple[torch.Tensor, torch.Tensor]]  # between devices: one copy_ each

    @classmethod
    def of(cls, buffer: torch.Tensor, planned: _PlannedBucket) -> _Copies:
        copies = cls([], [], [], [])
        for piece, dtype in zip(planned.pieces, planned.dtypes):
            dst = buffer[piece.offset : piece.offset + _nbytes(piece, dtype)]
            dst = dst.view(dtype_of(dtype)).view(piece.size)
            src = piece.view()
            if dst.device != src.device:
                copies.across.append((dst, src))
            elif dst.numel() >= LARGE and _memcpy_applies(dst, src):
                copies.large.append((dst, src))
            else:
                copies.dst.append(dst)
                copies.src.append(src)
        return copies

    def run(self) -> None:
        for dst, src in self.large:
            _memcpy(dst, src)
        for dst, src in self.across:
            dst.copy_(src)
        if self.dst:
            torch._foreach_copy_(self.dst, self.src)


class PushPlan:
    """The buckets of one rank's push, replayable while the parameters keep their
    storage (see the module docstring)."""

    def __init__(self, buckets: list[_PlannedBucket], storages: dict[int, torch.Tensor]) -> None:
        self._buckets = buckets
        self._storages = storages  # storage address when recorded -> a parameter on it
        self._copies: dict[tuple[int, int], _Copies] = {}  # (buffer, bucket) -> its copies

    def valid(self) -> bool:
        """Every parameter the plan reads still lives where it was recorded."""
        return all(t.untyped_storage().data_ptr() == ptr for ptr, t in self._storages.items())

    @classmethod
    def record(
        cls,
        stream: Iterable[tuple[str, torch.Tensor]],
        params: Iterable[torch.Tensor],
        limit_bytes: int,
        dtype: torch.dtype | None,
        staging: Staging,
        keep: Callable[[str], bool] | None = None,
    ) -> Iterator[tuple[Bucket, bool] | PushPlan | None]:
        """``bucketize``'s buckets of ``stream``, as it gives them, then the plan (None
        when this push cannot be replayed). ``params``: the tensors views may come from;
        ``keep``: as ``bucketize``'s."""
        owners = {p.untyped_storage().data_ptr(): p for p in params}
        pieces: dict[str, tuple[torch.Tensor, torch.Tensor] | None] = {}

        def watched() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in stream:
                owner = owners.get(tensor.untyped_storage().data_ptr())
                pieces[name] = None if owner is None else (owner, tensor.detach())
                yield name, tensor

        planned: list[_PlannedBucket] | None = []
        for bucket, last in bucketize(watched(), limit_bytes, dtype, staging, keep=keep):
            if planned is not None:
                planned = cls._add(planned, bucket, pieces, limit_bytes)
            yield bucket, last
        used = {} if planned is None else _used(planned)
        yield None if not planned else cls(planned, used)

    @staticmethod
    def _add(
        planned: list[_PlannedBucket],
        bucket: Bucket,
        pieces: dict[str, tuple[torch.Tensor, torch.Tensor] | None],
        limit_bytes: int,
    ) -> list[_PlannedBucket] | None:
        if bucket.tensors is not None or bucket.nbytes > limit_bytes:
            return None  # borrowed, or a lone tensor sent from its own bytes
        entry = _PlannedBucket(
            list(bucket.names), list(bucket.dtypes), bucket.shapes, bucket.nbytes
        )
        offset = 0
        for name, dtype, shape in zip(bucket.names, bucket.dtypes, bucket.shapes):
            source = pieces.get(name)
            itemsize = dtype_of(dtype).itemsize
            if source is None or offset % itemsize:
                return None
            owner, view = source
            entry.pieces.append(
                _Piece(owner, tuple(view.shape), view.stride(), int(view.storage_offset()), offset)
            )
            offset += torch.Size(shape).numel() * itemsize
        planned.append(entry)
        return planned

    def buckets(self, staging: Staging) -> Iterator[tuple[Bucket, bool]]:
        """The recorded buckets with the parameters' current values, each gathered into
        the next staging buffer (as ``bucketize`` would: same bytes, same metadata)."""
        for k, planned in enumerate(self._buckets):
            last = k == len(self._buckets) - 1
            if not planned.pieces:  # the empty last bucket bucketize may end with
                yield Bucket(names=[], dtypes=[], shapes=[]), last
                continue
            buffer = staging.next()
            key = (buffer.data_ptr(), k)
            if key not in self._copies:
                self._copies[key] = _Copies.of(buffer, planned)
            self._copies[key].run()
            bucket = Bucket(
                names=planned.names, dtypes=planned.dtypes, shapes=planned.shapes,
                nbytes=planned.nbytes, flat=buffer[: planned.nbytes],
            )  # fmt: skip
            yield bucket, last


LARGE = 1 << 16
"""Elements from which a piece is copied on its own, by one thread where it can be
(``moerl.sync.stream._copy_into`` says why); smaller ones go in one ``_foreach_copy_``."""


def _memcpy_applies(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether ``_memcpy`` can copy ``src`` into ``dst``: contiguous same-dtype CPU bytes."""
    same = src.dtype == dst.dtype and src.is_contiguous() and dst.is_contiguous()
    return same and src.device.type == "cpu" and dst.device.type == "cpu"


def _memcpy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """One thread's copy of contiguous same-dtype CPU bytes."""
    np.copyto(dst.reshape(-1).view(torch.uint8).numpy(), src.reshape(-1).view(torch.uint8).numpy())


def _nbytes(piece: _Piece, dtype: str) -> int:
    return nbytes(dtype_of(dtype), piece.size)


def _used(planned: list[_PlannedBucket]) -> dict[int, torch.Tensor]:
    return {p.base.untyped_storage().data_ptr(): p.base for b in planned for p in b.pieces}
