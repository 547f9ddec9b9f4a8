"""The LoRA pairs of one megatron-core linear and their tensor-parallel forward.

A ``LoraAdapter`` holds one (A, B) pair per HF module its base linear fuses: one for
``linear_proj``, two for ``linear_fc1`` (gate, up), three for GQA ``linear_qkv``
(q, k, v). It adds ``scaling · B A dropout(x)`` to the base output through a forward
hook, so the base module, its state dict keys and its sharded state dict stay as
they are. The split of A and B follows the base layer's split:

- ColumnParallelLinear (output split): A [r, in] replicated, B [out/tp, r] split on
  the output dim, so each rank produces its slice of the output, in the same local
  layout as the base (fc1: [gate_r | up_r]; qkv: per local query group [q | k | v]).
- RowParallelLinear (input split): A [r, in/tp] split on the input dim, B [out, r]
  replicated. The partial ``A_r x_r`` is reduced where the base reduces its partial
  output, but on r columns instead of out: all-reduce (no sequence parallelism),
  reduce-scatter along the sequence (sequence parallelism), or not at all for experts
  (the token dispatcher reduces expert outputs over expert-TP, so ``B h_r`` stays
  partial and sums there).

Gradients follow from where the rank-r activations are communicated; a replicated
weight whose gradient is a per-rank partial sum goes through
``copy_to_tensor_model_parallel_region`` (identity forward, all-reduce backward), so
every replica gets the full gradient without help from ``finalize_model_grads``.
"""

# S sequence (this rank's), B batch, I in features, O out features, r rank, n parts

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from moerl.lora.bases import (
    COLUMN,
    REPLICATED,
    ROW,
    SEQUENCE,
    ExpertSlice,
    parallel_kind,
)


def module_seed(seed: int, hf_module: str) -> int:
    """A stable per-module seed: the same in every process and layout."""
    return zlib.crc32(f"{seed}:{hf_module}".encode()) & 0x7FFFFFFF


def init_pair(
    hf_module: str, rank: int, fan_in: int, fan_out: int, seed: int, b_std: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Full (A [r, in], B [out, r]) of one module: A as PEFT's kaiming_uniform(a=√5),
    B zero (or normal with ``b_std``, so that a test's adapter matters from the start)."""
    gen = torch.Generator().manual_seed(module_seed(seed, hf_module))
    bound = 1.0 / math.sqrt(fan_in)
    a = (torch.rand(rank, fan_in, generator=gen) * 2.0 - 1.0) * bound
    b = torch.randn(fan_out, rank, generator=gen) * b_std if b_std else torch.zeros(fan_out, rank)
    return a, b


class LoraAdapter(torch.nn.Module):
    """LoRA pairs on one base linear (see module docstring). ``hf_modules`` name the
    parts of the base output in order, ``out_sizes`` their full sizes, ``groups`` how
    many interleaved groups the full output has (qkv: query groups, split over TP);
    ``active`` says which parts get a pair (the others add zero)."""

    def __init__(
        self,
        base: Any,  # a megatron-core linear or an ExpertSlice, read by attribute name
        hf_modules: list[str],
        out_sizes: list[int],
        rank: int,
        scaling: float,
        dropout: float = 0.0,
        groups: int = 1,
        active: list[bool] | None = None,
    ) -> None:
        super().__init__()
        self.kind, self.mode = parallel_kind(base)
        self.group = base.tp_group
        self.tp = torch.distributed.get_world_size(self.group) if self.group is not None else 1
        self.tp_rank = torch.distributed.get_rank(self.group) if self.tp > 1 else 0
        if self.kind == ROW and len(hf_modules) != 1:
            raise NotImplementedError(f"a row-parallel linear fusing {hf_modules}")
        if dropout and self.kind == COLUMN and self.mode != SEQUENCE and self.tp > 1:
            # The input is replicated over the TP group, so every rank would need the same
            # mask; megatron-core has no RNG stream shared by exactly that group.
            raise ValueError(
                f"lora.dropout={dropout} on {hf_modules[0]}: adapter dropout on a "
                f"{self.mode} column-parallel input with TP={self.tp} is not supported; "
                "use lora.dropout=0 or sequence parallelism"
            )
        self.hf_modules = list(hf_modules)
        self.active = list(active) if active is not None else [True] * len(hf_modules)
        self._slot = {p: i for i, p in enumerate(p for p, on in enumerate(self.active) if on)}
        self.out_sizes = list(out_sizes)
        self.in_size = base.input_size
        self.folded = False  # set by moerl.trainer.fused_head for an lm_head adapter
        self.rank = rank
        self.scaling = scaling
        self.dropout = dropout
        self.local_groups = groups // self.tp if groups > 1 else 1
        dtype, dev = base.weight.dtype, base.weight.device
        self.lora_A = torch.nn.ParameterList()
        self.lora_B = torch.nn.ParameterList()
        for out in (o for o, on in zip(out_sizes, self.active, strict=True) if on):
            a_shape, b_shape = [rank, base.input_size], [out, rank]
            if self.kind == COLUMN:
                b_shape[0] = out // self.tp
            else:
                a_shape[1] = base.input_size // self.tp
            self.lora_A.append(torch.nn.Parameter(torch.zeros(a_shape, dtype=dtype, device=dev)))
            self.lora_B.append(torch.nn.Parameter(torch.zeros(b_shape, dtype=dtype, device=dev)))
        self._mark_params(base)

    def _mark_params(self, base: torch.nn.Module | ExpertSlice) -> None:
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        split = self.lora_B if self.kind == COLUMN else self.lora_A
        dim = 0 if self.kind == COLUMN else 1
        for param in [*self.lora_A, *self.lora_B]:
            # experts' params are reduced over expert data parallel, like the base weight
            param.allreduce = getattr(base.weight, "allreduce", True)  # type: ignore[attr-defined]
            if any(param is p for p in split) and self.tp > 1:
                set_tensor_model_parallel_attributes(param, True, dim, 1)
            else:
                set_tensor_model_parallel_attributes(param, False, -1, 1)

    def active_parts(self) -> Iterator[tuple[int, str]]:
        """(part index, HF module name) of every part that has a pair."""
        for part in self._slot:
            yield part, self.hf_modules[part]

    def pair(self, part: int) -> tuple[torch.nn.Parameter, torch.nn.Parameter]:
        slot = self._slot[part]
        return self.lora_A[slot], self.lora_B[slot]

    # -- full ⇄ local -----------------------------------------------------------------------
    def split_dim(self, which: str) -> int | None:
        """The dim of the full A ('A') or B ('B') this rank holds a 1/tp slice of."""
        if self.kind == COLUMN:
            return 0 if which == "B" else None
        return 1 if which == "A" else None

    def local_slice(self, full: torch.Tensor, which: str) -> torch.Tensor:
        dim = self.split_dim(which)
        if dim is None or self.tp == 1:
            return full
        return torch.chunk(full, self.tp, dim=dim)[self.tp_rank]

    @torch.no_grad()
    def set_full(self, part: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Write this rank's slices of a part's full A and B."""
        param_a, param_b = self.pair(part)
        param_a.copy_(self.local_slice(a, "A"))
        param_b.copy_(self.local_slice(b, "B"))

    # -- forward ----------------------------------------------------------------------------
    def _copy(self, t: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

        return copy_to_tensor_model_parallel_region(t, group=self.group) if self.tp > 1 else t

    def delta(self, x_SBI: torch.Tensor) -> torch.Tensor:
        """The adapter's contribution to the base output of this rank."""
        from megatron.core import tensor_parallel as tpar

        if self.dropout and self.training:
            x_SBI = F.dropout(x_SBI, self.dropout)
        tp, group = self.tp, self.group
        a = torch.cat(list(self.lora_A), dim=0)  # [n·r, I or I/tp]
        if self.kind == ROW:
            h_SBr = F.linear(x_SBI, a)  # partial over the TP group
            b = self.lora_B[0]
            if tp > 1 and self.mode == REPLICATED:
                h_SBr = tpar.reduce_from_tensor_model_parallel_region(h_SBr, group=group)
            elif tp > 1 and self.mode == SEQUENCE:
                h_SBr = tpar.reduce_scatter_to_sequence_parallel_region(h_SBr, group=group)
                b = self._copy(b)  # each rank saw only its sequence slice
            else:
                b = self._copy(b)  # h stays partial: the dispatcher sums B h_r over expert TP
            return F.linear(h_SBr, b) * self.scaling

        if self.mode == REPLICATED:
            h_SBn = F.linear(x_SBI, a)
            if tp > 1:  # the full dh is the sum of every rank's B_r^T dy_r
                h_SBn = self._copy(h_SBn)
        elif self.mode == SEQUENCE:
            h_SBn = F.linear(x_SBI, self._copy(a))
            if tp > 1:
                h_SBn = tpar.gather_from_sequence_parallel_region(
                    h_SBn, tensor_parallel_output_grad=True, group=group
                )
        else:  # expert: dx stays partial like the base's; dA is summed over expert TP
            h_SBn = F.linear(x_SBI, self._copy(a))
        h_r = iter(torch.split(h_SBn, self.rank, dim=-1))
        outs = []
        for part, on in enumerate(self.active):
            if on:
                out = F.linear(next(h_r), self.lora_B[self._slot[part]])
            else:
                size = self.out_sizes[part] // tp
                out = h_SBn.new_zeros(*h_SBn.shape[:-1], size)
            g = self.local_groups  # explicit sizes: an expert may get zero tokens
            outs.append(out.reshape(*out.shape[:-1], g, out.shape[-1] // g))
        out = torch.cat(outs, dim=-1)
        return out.reshape(*out.shape[:-2], out.shape[-2] * out.shape[-1]) * self.scaling

    def hook(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: tuple) -> tuple:
        if self.folded:  # the fused logprob head applies this adapter itself
            return output
        x = args[0] if args else kwargs["input_"]
        out, bias = output
        return out + self.delta(x).to(out.dtype), bias


class LoraAdapters(torch.nn.Module):
    """Every adapter of one model chunk, keyed by a name derived from the HF module.
    Kept out of megatron-core's sharded state dict, so conversion and weight export
    see only the base model; adapters move with ``moerl.lora.export``."""

    def __init__(self) -> None:
        super().__init__()
        self.adapters = torch.nn.ModuleDict()
        self.handles: list = []

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:  # type: ignore[no-untyped-def]
        return {}
