"""Parallel layout: tensor, pipeline, expert (and expert-tensor) and data parallelism.

The layout is validated once, at start-up, before any process group exists, so a
bad combination fails with a readable message instead of a hang inside gloo/NCCL.
"""

from __future__ import annotations

from dataclasses import dataclass


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class ParallelConfig:
    """How the trainer's world is split. DP is derived: world / (TP × PP × CP)."""

    tp: int = 1
    """Tensor-parallel size (attention heads and dense MLPs are split this many ways)."""
    pp: int = 1
    """Pipeline-parallel size (transformer layers are split into this many stages)."""
    ep: int = 1
    """Expert-parallel size (routed experts are distributed over this many ranks)."""
    etp: int | None = None
    """Expert-tensor-parallel size (each expert's MLP is split this many ways); None = same as tp."""
    sequence_parallel: bool | None = None
    """Shard activations along the sequence in TP regions; None = on whenever tp > 1
    (megatron-core requires it for MoE with tp > 1)."""
    micro_batch_size: int = 1
    """Sequences per micro-batch on each DP rank."""
    virtual_pp: int | None = None
    """Virtual pipeline stages per rank (interleaved 1F1B); None = plain 1F1B.
    Refused at validation until the interleaved schedule passes the parity check."""

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    def use_sequence_parallel(self) -> bool:
        return self.tp > 1 if self.sequence_parallel is None else self.sequence_parallel

    def dp(self, world_size: int) -> int:
        return world_size // (self.tp * self.pp)

    def name(self) -> str:
        """Short layout name as used by tools/check_parallel.py, e.g. 'tp2ep2'."""
        parts = []
        for key, val in (("tp", self.tp), ("pp", self.pp), ("etp", self.etp), ("ep", self.ep)):
            if val is not None and val > 1:
                parts.append(f"{key}{val}")
        return "".join(parts) or "single"

    def validate(
        self,
        world_size: int,
        *,
        num_layers: int,
        num_attention_heads: int,
        num_query_groups: int | None = None,
        num_experts: int | None = None,
    ) -> None:
        """Raise ValueError naming the bad value and the valid choices."""
        for key in ("tp", "pp", "ep", "micro_batch_size"):
            val = getattr(self, key)
            if not isinstance(val, int) or val < 1:
                raise ValueError(f"parallel.{key}={val!r} must be a positive integer")
        if self.etp is not None and (not isinstance(self.etp, int) or self.etp < 1):
            raise ValueError(f"parallel.etp={self.etp!r} must be a positive integer or null")
        if world_size < 1:
            raise ValueError(f"world size {world_size} must be at least 1")

        model_ranks = self.tp * self.pp
        if world_size % model_ranks:
            valid = [d for d in _divisors(world_size)]
            raise ValueError(
                f"world size {world_size} is not divisible by parallel.tp × parallel.pp = "
                f"{self.tp} × {self.pp} = {model_ranks}; choose tp × pp from {valid}"
            )
        heads_groups = num_query_groups or num_attention_heads
        if num_attention_heads % self.tp or heads_groups % self.tp:
            valid = [d for d in _divisors(num_attention_heads) if heads_groups % d == 0]
            raise ValueError(
                f"parallel.tp={self.tp} does not divide model.num_attention_heads="
                f"{num_attention_heads} (query groups {heads_groups}); choose tp from {valid}"
            )
        if self.pp > num_layers:
            raise ValueError(
                f"parallel.pp={self.pp} exceeds model.num_layers={num_layers}; "
                f"choose pp from 1..{num_layers}"
            )
        if num_layers % self.pp:
            valid = [d for d in _divisors(num_layers)]
            raise ValueError(
                f"parallel.pp={self.pp} does not divide model.num_layers={num_layers}; "
                f"choose pp from {valid}"
            )
        if self.virtual_pp is not None:
            # The interleaved schedule builds and runs on CPU, but its loss and gradients do
            # not yet match the single-process run in tools/check_parallel.py; refuse it
            # rather than train on unverified numerics.
            raise ValueError(
                f"parallel.virtual_pp={self.virtual_pp}: interleaved pipeline stages are not "
                "supported yet (they fail moerl's parity check); set parallel.virtual_pp=null"
            )
        if num_experts is None:
            if self.ep > 1 or (self.etp is not None and self.etp > 1):
                raise ValueError(
                    f"parallel.ep={self.ep} / parallel.etp={self.etp} need an MoE model; "
                    "the model has no experts, set ep=1 and etp=null"
                )
            return
        if num_experts % self.ep:
            valid = _divisors(num_experts)
            raise ValueError(
                f"parallel.ep={self.ep} does not divide model.num_experts={num_experts}; "
                f"choose ep from {valid}"
            )
        # megatron-core builds the expert grid from the same ranks as the dense grid:
        # world = PP × ETP × EP × expert-DP, so ETP × EP must divide world / PP.
        per_stage = world_size // self.pp
        expert_model = self.expert_tp * self.ep
        if per_stage % expert_model:
            valid = [d for d in _divisors(per_stage) if num_experts % d == 0]
            raise ValueError(
                f"parallel.etp × parallel.ep = {self.expert_tp} × {self.ep} = {expert_model} "
                f"does not divide the {per_stage} ranks of each pipeline stage "
                f"(world {world_size} / pp {self.pp}); choose ep from {valid} for etp={self.expert_tp}"
            )
