"""The payload of ``/update_weights_from_tensor`` (SGLang 0.5.23's same-host weight path).

``serialized_named_tensors`` holds one base64 string per tensor-parallel rank of the
engine: a ``ForkingPickler`` dump (SGLang's ``MultiprocessingSerializer``) of the named
tensors, in which a tensor travels as a handle, not bytes: a shared-memory file name for a
CPU tensor (torch's ``file_system`` sharing strategy, the one an unrelated process can open)
or a CUDA IPC handle. What it unpickles to depends on ``load_format``:

- ``None`` or ``"direct"``: a list of ``(name, tensor)`` pairs (views of one shared buffer
  share one handle);
- ``"flattened_bucket"``: ``{"flattened_tensor": uint8 [N], "metadata": [...]}``, each
  metadata entry SGLang's ``FlattenedTensorMetadata`` (name, shape, dtype, start_idx,
  end_idx, numel: a byte range of the flat tensor).

An engine running inside the sender's process (``launcher.placement=colocated`` with one
process) cannot open an IPC handle of its own process (CUDA refuses it: "invalid device
context"), so that sender writes *in-process* handles instead (``serialize_named_tensors(...,
in_process=True)``): a random key into this process's table of the tensors, which the
engine reads back without a copy; any other process finds no such key and says so.

The payload comes from the network, so it is read as SGLang reads it: an unpickler that
builds only data containers and torch's tensor-rebuild functions (and the in-process
lookup) and refuses every other global. SGLang's metadata class is read into a stand-in with its fields, so the engine
needs no sglang install.
"""

from __future__ import annotations

import base64
import binascii
import collections
import io
import pickle
import secrets
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

SGLANG_METADATA = ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata")
LOAD_FORMATS = (None, "direct", "flattened_bucket")


@dataclass
class FlattenedTensorMetadata:
    """SGLang's metadata of one tensor in a flattened bucket (bytes start_idx:end_idx)."""

    name: str
    shape: Any
    dtype: Any
    start_idx: int
    end_idx: int
    numel: int


_TORCH_NAMES = (
    "Tensor", "Size", "device", "dtype", "UntypedStorage", "TypedStorage",
    "ByteStorage", "CharStorage", "ShortStorage", "IntStorage", "LongStorage",
    "HalfStorage", "FloatStorage", "DoubleStorage", "BFloat16Storage", "BoolStorage",
)  # fmt: skip
_ALLOWED = {
    *(("builtins", n) for n in ("bool", "bytes", "dict", "float", "int", "list", "str", "tuple")),
    ("collections", "OrderedDict"),
    ("copyreg", "__newobj__"),
    *(("torch", n) for n in _TORCH_NAMES),
    ("torch.storage", "UntypedStorage"),
    ("torch.storage", "TypedStorage"),
    ("torch._utils", "_rebuild_tensor"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_parameter"),
    ("torch._tensor", "_rebuild_from_type_v2"),
    ("torch.nn.parameter", "Parameter"),
    *(
        ("torch.multiprocessing.reductions", n)
        for n in (
            "rebuild_tensor",
            "rebuild_cuda_tensor",
            "rebuild_storage_filename",
            "rebuild_storage_empty",
            "rebuild_typed_storage",
            "rebuild_typed_storage_child",
        )
    ),  # fmt: skip
}


# key -> tensor, for an engine in this process; an entry lives as long as the sender
# keeps its tensor (the tensor wire holds its views until the engines answered)
_IN_PROCESS: weakref.WeakValueDictionary[str, torch.Tensor] = weakref.WeakValueDictionary()


def in_process_tensor(key: str) -> torch.Tensor:
    """The tensor an in-process handle names (the unpickler's only non-torch function)."""
    try:
        return _IN_PROCESS[key]
    except KeyError:
        raise ValueError(
            f"in-process tensor handle {key!r} is not held by this process: such handles "
            "are written for an engine inside the sender's process (launcher.placement="
            "colocated) and are read while the sender keeps the tensor; an engine in "
            "another process needs shared-memory or CUDA IPC handles (in_process=False)"
        ) from None


class _InProcessPickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            key = secrets.token_hex(16)
            _IN_PROCESS[key] = obj
            return in_process_tensor, (key,)
        return NotImplemented


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == SGLANG_METADATA:
            return FlattenedTensorMetadata
        if (module, name) == (__name__, "in_process_tensor"):
            return in_process_tensor
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refused to load {module}.{name} (not tensor data)")


class MappedStorages:
    """The sender's shared-memory storages this engine mapped, kept mapped (least recently
    used dropped beyond ``max_bytes``). torch unmaps a storage once its last tensor is
    gone and maps it again, page by page, on the next push; a sender whose buffers or
    parameters stay put across pushes (moerl's trainer) then costs a page fault per 4 KB
    per push, and the unmapping as much again. Keeping them mapped also keeps them alive
    after the sender frees them, which ``max_bytes`` bounds."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._kept: collections.OrderedDict[int, torch.UntypedStorage] = collections.OrderedDict()
        self.bytes = 0

    def keep(self, tensors: Iterable[torch.Tensor]) -> None:
        for tensor in tensors:
            if tensor.device.type != "cpu" or not tensor.is_shared():
                continue
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key in self._kept:
                self._kept.move_to_end(key)
                continue
            self._kept[key] = storage
            self.bytes += storage.nbytes()
        while self.bytes > self.max_bytes and self._kept:
            _, dropped = self._kept.popitem(last=False)
            self.bytes -= dropped.nbytes()

    def __len__(self) -> int:
        return len(self._kept)


def read_named_tensors(
    payloads: Any, load_format: str | None, mapped: MappedStorages | None = None
) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of TP rank 0's payload; ValueError naming what is wrong. With
    ``mapped``, their shared-memory storages stay mapped for the next push."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(
            f"load_format={load_format!r}: this engine loads null, 'direct' or 'flattened_bucket'"
        )
    if not isinstance(payloads, list) or not payloads or not isinstance(payloads[0], str):
        raise ValueError(
            "serialized_named_tensors must be a non-empty list of base64 strings (one per "
            "tensor-parallel rank: MultiprocessingSerializer.serialize(..., output_str=True))"
        )
    try:
        raw = base64.b64decode(payloads[0], validate=True)
    except (binascii.Error, ValueError) as err:
        raise ValueError(f"serialized_named_tensors[0] is not base64: {err}") from None
    try:
        obj = _SafeUnpickler(io.BytesIO(raw)).load()
    except Exception as err:  # a refused global, a truncated dump, a vanished shm file
        raise ValueError(
            f"serialized_named_tensors[0] could not be read ({type(err).__name__}: {err}); "
            "CPU tensors must be shared with torch's file_system strategy by a process on "
            "this host that keeps them alive until the answer"
        ) from None
    named = _unflatten(obj) if load_format == "flattened_bucket" else obj
    if not isinstance(named, (list, tuple)) or not all(
        isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], str)
        and isinstance(p[1], torch.Tensor) for p in named
    ):  # fmt: skip
        raise ValueError(
            f"load_format={load_format!r} needs a list of (name, tensor) pairs"
            + (
                " (flattened_bucket: a dict of flattened_tensor and metadata)"
                if load_format
                else ""
            )
        )
    if mapped is not None:
        mapped.keep(tensor for _, tensor in named)
    return [(name, tensor) for name, tensor in named]


def _unflatten(obj: Any) -> list[tuple[str, torch.Tensor]]:
    if not isinstance(obj, dict) or not {"flattened_tensor", "metadata"} <= set(obj):
        raise ValueError(
            "load_format='flattened_bucket' needs {'flattened_tensor': uint8 tensor, "
            "'metadata': [FlattenedTensorMetadata, ...]}"
        )
    flat, metadata = obj["flattened_tensor"], obj["metadata"]
    if not isinstance(flat, torch.Tensor) or flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError("flattened_tensor must be a 1-D uint8 tensor")
    out = []
    for i, meta in enumerate(metadata):
        if not isinstance(meta, FlattenedTensorMetadata) or not isinstance(meta.dtype, torch.dtype):
            raise ValueError(f"metadata[{i}] is not a FlattenedTensorMetadata")
        shape = torch.Size(meta.shape)
        size = shape.numel() * meta.dtype.itemsize
        if not 0 <= meta.start_idx <= meta.start_idx + size == meta.end_idx <= flat.numel():
            raise ValueError(
                f"metadata[{i}] ({meta.name}): bytes {meta.start_idx}:{meta.end_idx} do not "
                f"hold {tuple(shape)} {meta.dtype} inside the {flat.numel()}-byte bucket"
            )
        if meta.start_idx % meta.dtype.itemsize:
            raise ValueError(f"metadata[{i}] ({meta.name}): byte offset {meta.start_idx} unaligned")
        piece = flat[meta.start_idx : meta.end_idx].view(meta.dtype).view(shape)
        out.append((meta.name, piece))
    return out


def serialize_named_tensors(obj: Any, in_process: bool = False) -> str:
    """SGLang's ``MultiprocessingSerializer.serialize(obj, output_str=True)``: tensors as
    handles (the caller shares CPU tensors with the file_system strategy and keeps them
    alive until the engine answers). One dump is for one reader: torch adds a reference to
    each shared CPU storage per dump and the reader's load takes it back, so two loads of
    one dump drop the last reference and the shared file is gone (SGLang serializes once
    per tensor-parallel rank for the same reason).

    ``in_process``: for an engine in this process, tensors as keys into this process's
    table instead (the module docstring says why); the reader gets the tensors themselves."""
    buf = io.BytesIO()
    if in_process:
        _InProcessPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    else:
        from multiprocessing.reduction import ForkingPickler

        import torch.multiprocessing  # noqa: F401  (registers torch's reductions)

        ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode()
