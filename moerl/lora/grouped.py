"""Routed experts' LoRA as one grouped matmul per linear, instead of one pair per expert.

megatron-core's ``SequentialMLP`` splits its permuted tokens by ``tokens_per_expert``,
runs each local expert's MLP (fc1, activation, the routing probabilities, fc2) on its
slice and concatenates the outputs. With a ``LoraAdapter`` hook on every expert linear
that is E pairs of rank-r matmuls per linear, tiny GEMMs that leave a GPU idle. Here
``moerl.kernels.lora_gmm.lora_grouped`` computes every expert's delta at once:

- fc1: a forward pre-hook on the ``SequentialMLP`` sees all its input tokens and the
  counts, computes every expert's fc1 delta in one call (A stacked [E, n·r, I]; B
  block-diagonal [E, O, n·r] in the base's local layout: gate rows read the gate rank
  columns, up rows the up ones, a part without a pair gets zero rows), splits it by
  expert, and each expert's fc1 hook adds its piece instead of computing its own.
- fc2: each expert's fc2 hook only records its input (fc1 output after the activation
  and the probabilities); a forward hook on the ``SequentialMLP`` computes all fc2
  deltas in one call on their concatenation and adds it to the concatenated output.
  That is the per-expert result because megatron applies the probabilities before
  fc2, and after fc2 only adds an expert bias (additive) before concatenating.

Expert tensor parallelism is handled as ``LoraAdapter.delta`` does in EXPERT mode: A
of fc1 and B of fc2 go through ``copy_to_tensor_model_parallel_region`` (one all-reduce
of the stacked gradient instead of one per expert), and fc2's rank-r activation stays
partial for the token dispatcher to sum. Dropout draws one mask over all experts'
tokens: the same distribution per element as per-expert masks, other draws.

Costs: the block-diagonal B multiplies zero blocks (n·r instead of r columns in the
second product), the fc2 inputs are concatenated (a copy of [T, O_fc1/2] kept for the
backward), and the counts go to the host once (megatron's ``SequentialMLP`` syncs on
them anyway). The hooks keep per-forward state, so activation recompute (which runs the
forward again) works; a pipeline schedule runs one micro-batch's expert forward at a
time.
"""

# T tokens (this rank's, grouped by local expert), E local experts, I in features,
# O out features (this rank's), r rank, n adapted parts of a fused linear

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from moerl.kernels.dispatch import use_triton
from moerl.kernels.lora_gmm import lora_grouped
from moerl.lora.bases import COLUMN, EXPERT
from moerl.lora.layers import LoraAdapter


def stacked_a(adapters: list[LoraAdapter]) -> torch.Tensor:
    """Every expert's parts' A, concatenated per expert as ``delta`` does: [E, n·r, I]."""
    parts = [a for adapter in adapters for a in adapter.lora_A]
    n = len(adapters[0].lora_A)
    a_XrI = torch.stack(parts)
    return a_XrI.reshape(len(adapters), n * a_XrI.shape[1], a_XrI.shape[2])


def stacked_b(adapters: list[LoraAdapter]) -> torch.Tensor:
    """Every expert's B as one block matrix on its concatenated rank: [E, O, n·r], with
    the rows in the base's local output layout (as ``LoraAdapter.delta`` builds it)."""
    lead = adapters[0]
    n, r, g = len(lead.lora_A), lead.rank, lead.local_groups
    blocks = []
    for part, on in enumerate(lead.active):
        if on:
            slot = lead._slot[part]
            b_EOr = torch.stack([adapter.lora_B[slot] for adapter in adapters])
            block = F.pad(b_EOr, (slot * r, (n - 1 - slot) * r)) if n > 1 else b_EOr
        else:
            size = lead.out_sizes[part] // lead.tp
            block = lead.lora_B[0].new_zeros(len(adapters), size, n * r)
        blocks.append(block.reshape(block.shape[0], g, block.shape[1] // g, n * r))
    b = torch.cat(blocks, dim=2)
    return b.reshape(b.shape[0], b.shape[1] * b.shape[2], n * r)


def grouped_delta(
    adapters: list[LoraAdapter], x_TI: torch.Tensor, tokens_per_expert: torch.Tensor
) -> torch.Tensor:
    """Every expert's ``delta`` on its segment of ``x_TI``, in one ``lora_grouped`` call."""
    lead = adapters[0]
    if lead.dropout and lead.training:
        x_TI = F.dropout(x_TI, lead.dropout)
    a_EnI, b_EOn = stacked_a(adapters), stacked_b(adapters)
    # expert TP: dA of a column-parallel fc1 and dB of a row-parallel fc2 are partial per
    # rank (see LoraAdapter.delta); identity when expert TP is 1
    if lead.kind == COLUMN:
        a_EnI = lead._copy(a_EnI)
    else:
        b_EOn = lead._copy(b_EOn)
    return lora_grouped(x_TI, a_EnI, b_EOn, tokens_per_expert, lead.scaling)


@dataclass
class _Pass:
    """What one forward of the SequentialMLP carries from hook to hook."""

    fc1_pieces: list[torch.Tensor] | None  # expert i's fc1 delta, [tokens_i, O]
    fc2_inputs: list[torch.Tensor] = field(default_factory=list)


class GroupedExperts:
    """The grouped LoRA of one ``SequentialMLP``: hooks on it and on its experts' fc1 and
    fc2 (``fc1`` / ``fc2``: every local expert's adapter, in local order, or None where
    that linear is not adapted). ``mode``: 'on' groups every forward, 'auto' only those
    whose inputs the Triton kernel would take; otherwise each expert's adapter runs its
    own ``hook``."""

    def __init__(
        self,
        experts: Any,  # megatron-core's SequentialMLP
        fc1: list[LoraAdapter] | None,
        fc2: list[LoraAdapter] | None,
        mode: str,
    ) -> None:
        self.experts = experts
        self.fc1, self.fc2, self.mode = fc1, fc2, mode
        self._pass: _Pass | None = None
        for adapters in (fc1 or [], fc2 or []):
            for adapter in adapters:
                # other modes cannot occur on routed experts; their comms are not grouped
                assert adapter.mode == EXPERT or adapter.tp == 1, adapter.mode
                assert adapter.active == adapters[0].active, adapter.hf_modules

    def install(self) -> list[torch.utils.hooks.RemovableHandle]:
        handles = [
            self.experts.register_forward_pre_hook(self._pre, with_kwargs=True),
            self.experts.register_forward_hook(self._post, with_kwargs=True),
        ]
        for i, expert in enumerate(self.experts.local_experts):
            if self.fc1 is not None:
                hook = functools.partial(self._fc1, i)
                handles.append(expert.linear_fc1.register_forward_hook(hook, with_kwargs=True))
            if self.fc2 is not None:
                hook = functools.partial(self._fc2, i)
                handles.append(expert.linear_fc2.register_forward_hook(hook, with_kwargs=True))
        return handles

    def _pre(self, module: Any, args: tuple, kwargs: dict) -> None:
        self._pass = None
        names = ("permuted_local_hidden_states", "tokens_per_expert", "permuted_probs")
        x_TI, counts_E, probs_T = (*args, *(kwargs[n] for n in names[len(args) :]))
        if not (self.mode == "on" or use_triton(x_TI)):
            return
        pieces = None
        if self.fc1 is not None:
            if module.config.moe_apply_probs_on_input:  # as SequentialMLP.forward does
                x_TI = (probs_T.unsqueeze(-1) * x_TI).to(x_TI.dtype)
            delta_TO = grouped_delta(self.fc1, x_TI, counts_E)
            # one split (not E slices): its backward assembles dy in one go
            sizes = counts_E.tolist() if len(self.fc1) > 1 else [x_TI.shape[0]]
            pieces = list(torch.split(delta_TO, sizes))
        self._pass = _Pass(pieces)

    def _fc1(self, index: int, module, args: tuple, kwargs: dict, output: tuple):  # type: ignore[no-untyped-def]
        state = self._pass
        if state is None or state.fc1_pieces is None:
            return self.fc1[index].hook(module, args, kwargs, output)  # type: ignore[index]
        out, bias = output
        piece = state.fc1_pieces[index]
        assert piece.shape[0] == out.shape[0], (index, piece.shape, out.shape)
        return out + piece.to(out.dtype), bias

    def _fc2(self, index: int, module, args: tuple, kwargs: dict, output: tuple):  # type: ignore[no-untyped-def]
        state = self._pass
        if state is None:
            return self.fc2[index].hook(module, args, kwargs, output)  # type: ignore[index]
        assert len(state.fc2_inputs) == index, (index, len(state.fc2_inputs))
        state.fc2_inputs.append(args[0] if args else kwargs["input_"])
        return None

    def _post(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: tuple):  # type: ignore[no-untyped-def]
        state, self._pass = self._pass, None
        if state is None or self.fc2 is None:
            return None
        inputs = state.fc2_inputs
        assert len(inputs) == len(self.fc2), (len(inputs), len(self.fc2))
        counts_E = torch.tensor([x.shape[0] for x in inputs])
        x_TI = torch.cat(inputs) if len(inputs) > 1 else inputs[0]
        out, bias = output
        return out + grouped_delta(self.fc2, x_TI, counts_E).to(out.dtype), bias


def _local(experts: Any, linear: str, adapted: dict) -> list[LoraAdapter] | None:
    found = [adapted.get(getattr(e, linear)) for e in experts.local_experts]
    if all(a is None for a in found):
        return None
    assert all(a is not None for a in found), f"some local experts lack a {linear} adapter"
    return found  # type: ignore[return-value]


def group_experts(
    chunk: torch.nn.Module, adapted: dict[torch.nn.Module, LoraAdapter], mode: str
) -> tuple[list[torch.utils.hooks.RemovableHandle], set[torch.nn.Module]]:
    """Install the grouped path on every ``SequentialMLP`` of ``chunk`` whose experts have
    adapters (``adapted``: base linear → its adapter). Returns the hook handles and the
    base linears now served by it (their adapters' own hooks must not be installed)."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    handles: list[torch.utils.hooks.RemovableHandle] = []
    served: set[torch.nn.Module] = set()
    if mode == "off":
        return handles, served
    for experts in chunk.modules():
        if not isinstance(experts, SequentialMLP):
            continue
        fc1 = _local(experts, "linear_fc1", adapted)
        fc2 = _local(experts, "linear_fc2", adapted)
        if fc1 is None and fc2 is None:
            continue
        if experts.config.fp8 or experts.config.fp4:
            # SequentialMLP pads each expert's tokens; the segments would not line up
            if mode == "on":
                raise NotImplementedError(
                    "lora.grouped_experts=on with fp8/fp4 experts; use 'auto' or 'off'"
                )
            continue
        handles += GroupedExperts(experts, fc1, fc2, mode).install()
        for e in experts.local_experts:
            served.update(m for m in (e.linear_fc1, e.linear_fc2) if m in adapted)
    return handles, served
