"""Reading HF safetensors checkpoints (single file or sharded with an index), with
errors that name the file and tensor, and lazy slices so ranks read only what they own."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded as asked."""


def _check_file(path: Path) -> None:
    """Fail with the file name if a safetensors file is missing or truncated."""
    if not path.is_file():
        raise CheckpointError(f"missing checkpoint shard {path}: re-download or re-convert it")
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path} is truncated ({size} bytes): not a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            raise CheckpointError(f"{path} is truncated: header says {n} bytes, file has {size}")
        header = json.loads(f.read(n))
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        raise CheckpointError(
            f"{path} is truncated: tensors need {8 + n + end} bytes, file has {size}"
        )


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(
            f"{path} is not valid JSON ({err}): fix or re-download the file"
        ) from None


class HFCheckpoint:
    """Tensor names → files of an HF checkpoint directory."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        if not self.dir.is_dir():
            raise CheckpointError(f"checkpoint directory {self.dir} does not exist")
        index = self.dir / INDEX
        if index.is_file():
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index} has no weight_map: re-download or re-convert it")
            self.files = {name: self.dir / fname for name, fname in weight_map.items()}
        elif (self.dir / SINGLE).is_file():
            path = self.dir / SINGLE
            _check_file(path)
            with safe_open(str(path), "pt") as f:
                self.files = {name: path for name in f.keys()}
        else:
            raise CheckpointError(
                f"{self.dir} has neither {INDEX} nor {SINGLE}: not an HF safetensors checkpoint"
            )
        for path in sorted(set(self.files.values())):
            _check_file(path)
        self._open: dict[Path, Any] = {}

    def config(self) -> dict[str, Any]:
        path = self.dir / "config.json"
        if not path.is_file():
            raise CheckpointError(f"{path} is missing: every HF checkpoint needs its config.json")
        config = _read_json(path)
        if not isinstance(config, dict):
            raise CheckpointError(f"{path} holds {type(config).__name__}, not a JSON object")
        return config

    def names(self) -> set[str]:
        return set(self.files)

    def _handle(self, name: str) -> Any:
        if name not in self.files:
            raise CheckpointError(f"tensor {name!r} is not in the checkpoint {self.dir}")
        path = self.files[name]
        if path not in self._open:
            self._open[path] = safe_open(str(path), "pt")
        return self._open[path]

    def get(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def get_slice(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        """Read only ``index`` of a tensor (no full copy in memory)."""
        return self._handle(name).get_slice(name)[index]
