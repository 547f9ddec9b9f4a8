"""LoRA adapters on the trainer's megatron-core layers (group `lora`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from moerl.common.checks import one_of

ALL_LINEAR = "all-linear"
GROUPED_EXPERTS = ("auto", "on", "off")


@dataclass
class LoraConfig:
    """Low-rank adapters on attention, dense MLPs, shared experts and every routed expert.

    With ``enabled`` the base weights are frozen, only adapters are trained, and only
    adapters are synced to the engines (as a PEFT adapter in SGLang's naming).
    """

    enabled: bool = False
    """Train LoRA adapters instead of the full model."""
    rank: int = 16
    """Adapter rank r: A is [r, in], B is [out, r]."""
    alpha: float = 32.0
    """Scaling numerator: the adapter adds (alpha / rank) · B A x."""
    dropout: float = 0.0
    """Dropout on the adapter's input while training (0 disables)."""
    target_modules: list[str] = field(default_factory=lambda: [ALL_LINEAR])
    """HF module names to adapt, as in PEFT (q_proj, k_proj, v_proj, o_proj, q_a_proj,
    q_b_proj, kv_a_proj_with_mqa, kv_b_proj, gate_proj, up_proj, down_proj), or
    'all-linear' for every one the model family has. A name covers every module with
    that leaf: gate_proj adapts the dense MLPs, the shared experts and each routed expert."""
    seed: int = 0
    """Seed of the A initialisation; each module's generator is seeded by this and the
    module's HF name, so every layout starts from the same adapters."""
    grouped_experts: str = "auto"
    """How routed experts' adapters run: 'on' computes all local experts' deltas of a
    linear in one grouped matmul (``moerl.kernels.lora_gmm``; its torch twin where the
    Triton kernel cannot run), 'off' one pair of small matmuls per expert, 'auto' grouped
    where the Triton kernel runs (CUDA, see ``trainer.kernels``), per expert elsewhere.
    The results are the same; with dropout only the random masks differ. Experts in a
    transformer-engine grouped linear (``TEGroupedMLP``) always run grouped."""

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def validate(self, key: str = "lora") -> None:
        if self.rank < 1:
            raise ValueError(f"{key}.rank={self.rank} must be >= 1 (8 to 64 is typical)")
        if not self.alpha > 0:
            raise ValueError(f"{key}.alpha={self.alpha} must be positive (often 2 x rank)")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"{key}.dropout={self.dropout} must be in [0, 1)")
        one_of(f"{key}.grouped_experts", self.grouped_experts, GROUPED_EXPERTS)
        if not self.target_modules:
            raise ValueError(f"{key}.target_modules is empty; name modules or use ['all-linear']")
