"""Flattened weight buckets, byte-compatible with SGLang's ``flattened_bucket``.

A bucket is one uint8 tensor: every tensor, flattened and viewed as bytes, laid end
to end in the order of ``names``, with no padding. The receiver rebuilds the tensors
from ``names``, ``dtypes`` (torch attribute names such as "bfloat16") and ``shapes``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch


@functools.lru_cache(maxsize=64)
def dtype_of(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    value = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"dtype {name!r} is not a torch dtype name (e.g. 'bfloat16')")
    return value


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    return math.prod(shape) * dtype.itemsize


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One uint8 buffer holding ``tensors`` back to back."""
    return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def empty_bucket(
    dtypes: Sequence[str], shapes: Sequence[Sequence[int]], device: str = "cpu"
) -> torch.Tensor:
    total = sum(nbytes(dtype_of(d), s) for d, s in zip(dtypes, shapes))
    return torch.empty(total, dtype=torch.uint8, device=device)


def unflatten(
    buffer: torch.Tensor, dtypes: Sequence[str], shapes: Sequence[Sequence[int]]
) -> list[torch.Tensor]:
    """The tensors of a bucket, as views into ``buffer``."""
    out, pos = [], 0
    for d, shape in zip(dtypes, shapes):
        dtype = dtype_of(d)
        size = nbytes(dtype, shape)
        out.append(buffer[pos : pos + size].view(dtype).view(tuple(shape)))
        pos += size
    if pos != buffer.numel():
        raise ValueError(f"bucket has {buffer.numel()} bytes, the metadata describes {pos}")
    return out
