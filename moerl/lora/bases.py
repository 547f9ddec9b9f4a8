"""The base layers LoRA attaches to, and how each is split over tensor parallelism.

A megatron-core ``ColumnParallelLinear`` / ``RowParallelLinear`` is its own base; a
transformer-engine grouped linear (``TEGroupedMLP``'s fc1 / fc2) holds every local expert
in one module, so each expert is seen through an ``ExpertSlice`` (see ``te_grouped.py``).
``parallel_kind`` says how a base's input and output relate across its TP group, which
is what ``LoraAdapter`` (``layers.py``) splits its pairs by.
"""

from __future__ import annotations

from typing import Any

import torch

COLUMN, ROW = "column", "row"
# How the base layer's input/output relate across its tensor-parallel group.
REPLICATED, SEQUENCE, EXPERT = "replicated", "sequence_parallel", "expert"


def parallel_kind(base: torch.nn.Module | ExpertSlice) -> tuple[str, str]:
    """(COLUMN | ROW, REPLICATED | SEQUENCE | EXPERT) of a megatron-core linear, or of
    one expert of a transformer-engine grouped linear (``ExpertSlice``)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    if isinstance(base, ExpertSlice):
        kind = base.kind
    elif isinstance(base, ColumnParallelLinear):
        kind = COLUMN
        if base.gather_output:
            raise NotImplementedError(f"{type(base).__name__} with gather_output=True")
    elif isinstance(base, RowParallelLinear):
        kind = ROW
        if not base.input_is_parallel:
            raise NotImplementedError(f"{type(base).__name__} with input_is_parallel=False")
    elif type(base).__name__.startswith("TE"):
        raise NotImplementedError(
            f"LoRA on transformer-engine layers ({type(base).__name__}) is implemented for "
            "grouped experts only; build the model with the local spec (use_te=False)"
        )
    else:
        raise NotImplementedError(f"LoRA on {type(base).__name__} is not implemented")
    if base.explicit_expert_comm:
        return kind, EXPERT
    return kind, SEQUENCE if base.sequence_parallel else REPLICATED


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
