"""Declarative HF ⇄ Megatron tensor maps.

The Megatron side of every map is a key of megatron-core's sharded state dict:
layout-independent names with global layer numbers, where routed experts are one
tensor stacked along a leading expert axis. A converter turns the HF tensors of one
layer (and one expert) into that global Megatron tensor and back; sharding into
TP/PP/EP/ETP pieces is left to the sharded-state-dict offsets, so no map knows
about parallelism.
"""

# L layer, E expert, H hidden, I intermediate, G query groups, Dh head dim

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the maps are read by the preflight, which must not wait for torch
    import torch


class Converter:
    """Megatron tensor ⇄ HF tensors, for one layer (and one expert)."""

    hf: tuple[str, ...]

    def to_megatron(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def to_hf(self, tensor: torch.Tensor, views: bool = False) -> list[torch.Tensor]:
        """The HF tensors; ``views``: views of ``tensor`` where the split allows (the
        caller copies them, as weight sync does), else tensors of their own."""
        raise NotImplementedError


@dataclass
class Copy(Converter):
    """One tensor under another name."""

    name: str

    @property
    def hf(self) -> tuple[str, ...]:  # type: ignore[override]
        return (self.name,)

    def to_megatron(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        return tensors[0]

    def to_hf(self, tensor: torch.Tensor, views: bool = False) -> list[torch.Tensor]:
        return [tensor]


@dataclass
class Concat(Converter):
    """HF tensors concatenated along dim 0 (the fused gate/up of a gated MLP)."""

    names: tuple[str, ...]

    @property
    def hf(self) -> tuple[str, ...]:  # type: ignore[override]
        return self.names

    def to_megatron(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        import torch

        return torch.cat(tensors, dim=0)

    def to_hf(self, tensor: torch.Tensor, views: bool = False) -> list[torch.Tensor]:
        chunks = tensor.chunk(len(self.names), dim=0)
        return list(chunks) if views else [t.clone() for t in chunks]


@dataclass
class QKV(Converter):
    """Separate q/k/v projections ⇄ megatron-core's fused QKV, grouped per query group:
    for each of the G groups, its (heads / G) query heads, then its key, then its value."""

    names: tuple[str, str, str]
    heads: int
    groups: int
    head_dim: int

    @property
    def hf(self) -> tuple[str, ...]:  # type: ignore[override]
        return self.names

    def to_megatron(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        q, k, v = tensors
        hidden = q.shape[-1]
        per = self.heads // self.groups
        q_G = q.view(self.groups, per * self.head_dim, hidden)
        k_G = k.view(self.groups, self.head_dim, hidden)
        v_G = v.view(self.groups, self.head_dim, hidden)
        import torch

        return torch.cat([q_G, k_G, v_G], dim=1).reshape(-1, hidden)

    def to_hf(self, tensor: torch.Tensor, views: bool = False) -> list[torch.Tensor]:
        hidden = tensor.shape[-1]
        per = self.heads // self.groups
        qkv_G = tensor.view(self.groups, (per + 2) * self.head_dim, hidden)
        q, k, v = qkv_G.split([per * self.head_dim, self.head_dim, self.head_dim], dim=1)
        return [t.reshape(-1, hidden).clone() for t in (q, k, v)]


@dataclass
class Entry:
    """Megatron key suffix(es) → converter; ``expert`` entries are stacked over experts."""

    megatron: tuple[str, ...]
    converter: Converter
    expert: bool = False


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


@dataclass
class FamilyMap:
    """All entries of one model: ``globals`` (embedding, final norm, output) and
    per-layer entries for dense and MoE layers, HF names with ``{layer}``/``{expert}``."""

    globals: list[Entry]
    dense_layer: list[Entry]
    moe_layer: list[Entry]
    first_moe_layer: int
    num_layers: int
    hf_layer_prefix: str = "model.layers.{layer}."
    _index: dict[tuple[bool, str], Entry] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for entry in self.globals:
            for key in entry.megatron:
                self._index[(False, "g:" + key)] = entry
        for is_moe, entries in ((False, self.dense_layer), (True, self.moe_layer)):
            for entry in entries:
                for key in entry.megatron:
                    self._index[(is_moe, key)] = entry

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_moe_layer

    def lookup(self, megatron_key: str) -> tuple[Entry, int | None]:
        """The entry for a Megatron key and its layer number (None for global tensors)."""
        match = _LAYER.match(megatron_key)
        if match is None:
            entry = self._index.get((False, "g:" + megatron_key))
            layer = None
        else:
            layer = int(match.group(1))
            entry = self._index.get((self.is_moe_layer(layer), match.group(2)))
        if entry is None:
            raise KeyError(
                f"no HF mapping for Megatron tensor {megatron_key!r}: the family map does not "
                "cover this model's configuration"
            )
        return entry, layer

    def hf_names(self, entry: Entry, layer: int | None, expert: int | None = None) -> list[str]:
        prefix = "" if layer is None else self.hf_layer_prefix.format(layer=layer)
        return [prefix + name.format(expert=expert) for name in entry.converter.hf]

    def all_hf_names(self, num_experts: int | None) -> set[str]:
        names: set[str] = set()
        for entry in self.globals:
            names.update(self.hf_names(entry, None))
        for layer in range(self.num_layers):
            entries = self.moe_layer if self.is_moe_layer(layer) else self.dense_layer
            for entry in entries:
                experts = range(num_experts or 0) if entry.expert else [None]
                for e in experts:
                    names.update(self.hf_names(entry, layer, e))
        return names
