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

from moerl.lora.grouped import grouped_delta
from moerl.lora.layers import COLUMN, ROW, LoraAdapter

_KINDS = {"TEColumnParallelGroupedLinear": COLUMN, "TERowParallelGroupedLinear": ROW}


def is_te_grouped(module: torch.nn.Module) -> bool:
    """A megatron-core transformer-engine grouped linear (by class name: importing TE
    needs a GPU build)."""
    return any(cls.__name__ == "TEGroupedLinear" for cls in type(module).__mro__)


class ExpertSlice:
    """One local expert of a TE grouped linear, seen as a megatron-core linear by
    ``LoraAdapter`` (``parallel_kind``, sizes, TP group, weight dtype and ``allreduce``).
    ``tp_group``: the experts' TP group (``TEGroupedMLP.tp_group``); TE itself holds
    none under ``explicit_expert_comm``. Not a module: nothing hooks it."""

    def __init__(self, grouped: Any, index: int, tp_group: Any) -> None:
        config = grouped.config
        if config.fp8 or config.fp4:
            raise NotImplementedError(
                f"LoRA on transformer-engine grouped experts ({type(grouped).__name__}) "
                f"with fp8={config.fp8!r} / fp4={config.fp4!r} is not supported (padded "
                "tokens, quantized GEMM: untested with adapters); train LoRA without fp8/fp4, "
                "or build the model with the local spec (use_te=False, SequentialMLP experts)"
            )
        kinds = [_KINDS[c.__name__] for c in type(grouped).__mro__ if c.__name__ in _KINDS]
        if not kinds:
            raise NotImplementedError(f"LoRA on {type(grouped).__name__} is not implemented")
        # under explicit_expert_comm TE's parallel_mode is None: the class says which
        self.grouped, self.index, self.kind = grouped, index, kinds[0]
        self.weight = getattr(grouped, f"weight{index}")
        self.tp_group = tp_group
        self.explicit_expert_comm = grouped.explicit_expert_comm
        self.sequence_parallel = grouped.sequence_parallel
        tp = torch.distributed.get_world_size(tp_group) if tp_group is not None else 1
        self.input_size = grouped.in_features * (tp if self.kind == ROW else 1)
        self.output_size = grouped.out_features * (tp if self.kind == COLUMN else 1)


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
