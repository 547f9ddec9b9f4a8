"""LoRA on transformer-engine grouped experts (megatron-core's ``TEGroupedMLP``).

There, ``linear_fc1`` / ``linear_fc2`` are one ``TEColumnParallelGroupedLinear`` /
``TERowParallelGroupedLinear`` each, holding every local expert's weight as
``weight0 … weight{E-1}`` and called as ``linear(x, m_splits)`` on the tokens grouped by
expert. There is no module per expert to hook, so:

- ``find_targets`` gives one target per local expert, whose base is an ``ExpertSlice``:
  the attributes ``LoraAdapter`` reads from a megatron-core linear, for that expert.
  Its adapter is named, initialised and exported exactly as a ``SequentialMLP`` expert's
  (``…mlp.experts.{i}.gate_proj`` …), so both specs share adapters; its own ``hook`` is
  never installed.
- ``hook_te_grouped`` puts one forward hook on each grouped linear that adds every local
  expert's delta in one ``lora_grouped`` call (``moerl.lora.grouped.grouped_delta``),
  whatever ``lora.grouped_experts`` says. The hook sees fc1's input after
  ``moe_apply_probs_on_input`` scaled it, and fc2's after the activation and the
  probabilities, as ``TEGroupedMLP.forward`` passes them; fc2's output bias is added
  later, per expert, so adding the delta to the output is the per-expert result.

Under expert parallelism or expert TP, megatron-core builds these linears with
``explicit_expert_comm``: TE sees no parallel mode and local sizes (``in_features`` /
``out_features``), and the token dispatcher does the communication, as for a
``SequentialMLP`` expert; the full sizes are the local ones times expert TP on the split
dim. fp8/fp4 experts are refused: there TEGroupedMLP pads every expert's tokens and
runs the GEMM quantized, a path no test here covers.
"""

# T tokens (this rank's, grouped by local expert), E local experts, I in, O out features

from __future__ import annotations

import functools
from typing import Any

import torch

from moerl.lora.bases import ExpertSlice
from moerl.lora.grouped import grouped_delta
from moerl.lora.layers import LoraAdapter


def _hook(adapters: list[LoraAdapter], module: torch.nn.Module, args: tuple, kwargs: dict, output):  # type: ignore[no-untyped-def]
    x_TI = args[0] if args else kwargs["x"]
    m_splits = args[1] if len(args) > 1 else kwargs["m_splits"]
    out, bias = output
    counts_E = torch.as_tensor(m_splits)
    return out + grouped_delta(adapters, x_TI, counts_E).to(out.dtype), bias


def hook_te_grouped(
    adapted: dict[ExpertSlice, LoraAdapter],
) -> list[torch.utils.hooks.RemovableHandle]:
    """One forward hook per TE grouped linear whose experts have adapters (``adapted``:
    expert slice → its adapter). Returns the hook handles."""
    by_linear: dict[Any, list[ExpertSlice]] = {}
    for piece in adapted:
        by_linear.setdefault(piece.grouped, []).append(piece)
    handles = []
    for linear, pieces in by_linear.items():
        pieces.sort(key=lambda s: s.index)
        assert [s.index for s in pieces] == list(range(linear.num_gemms)), "experts lack adapters"
        hook = functools.partial(_hook, [adapted[s] for s in pieces])
        handles.append(linear.register_forward_hook(hook, with_kwargs=True))
    return handles
