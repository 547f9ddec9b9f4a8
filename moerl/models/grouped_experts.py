"""Routed experts in two grouped GEMMs instead of a Python loop over experts.

megatron-core builds the local (non-TE) experts as ``SequentialMLP``: one ``MLP`` per
expert, called in turn on its slice of the permuted tokens. At the small shapes of a
CPU run the loop is mostly per-op overhead (four GEMMs, an activation and a concat per
expert, forward and backward). ``GroupedSequentialMLP`` keeps the same modules and
parameters (so checkpoints, the weight maps, LoRA's targets and expert parallelism
see no difference) and, where it can, computes all local experts at once with
``grouped_mm`` over the experts' stacked weights:

    h = grouped_mm(x, stack(W1)ᵀ, offs);  h = act(h₁) · (h₂ + offset) · p;  y = grouped_mm(h, stack(W2)ᵀ, offs)

which is the ``MLP.forward`` path moerl's config takes (gated linear unit, no bias, no
fused activation) with the probabilities applied after the activation. Backward is
torch's own grouped backward for small experts; above ``NATIVE_BACKWARD_MAX_WEIGHT``
the input gradient is a grouped GEMM and the weight gradients one GEMM per expert
(``GroupedLinear``). On CPU, torch's grouped GEMM runs each group as the plain GEMM the
loop runs, so the results and gradients are bitwise the loop's
(``tests/dist/test_grouped_experts_layouts.py``); ``tools/bench/grouped_experts.py`` measures
1.5× on the tiny model's forward + backward and parity at the mid shape. The stack
copies the experts' weights in every forward and backward, which is nothing on a tiny
CPU model and real bandwidth on a large GPU one, so ``trainer.expert_gemm=auto`` takes
it on CPU only. On an H200 (bf16, 4096 tokens) it was 1.4× the loop at the tiny shape
and 2.2× at the mid one, as accurate against an fp64 reference as the loop (relative
error 2.9e-3 both); ``trainer.expert_gemm=grouped`` turns it on there.

It falls back to ``SequentialMLP.forward`` whenever the grouped path could mean
something else: hooks on the experts (LoRA's adapters hook them), transformer-engine
or other non-local linears, biases, fp8/fp4, probabilities applied on the input, a
shape or dtype the grouped kernel refuses (strides that are not multiples of 16 bytes;
on CUDA only bf16).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import SequentialMLP

from moerl.common.checks import one_of
from moerl.config.trainer import EXPERT_GEMMS


def grouped_mm_fn() -> Any:
    """torch's grouped GEMM (``F.grouped_mm``, else ``torch._grouped_mm``), or None."""
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def use_grouped(expert_gemm: str, has_cuda: bool) -> bool:
    """Whether ``trainer.expert_gemm`` builds ``GroupedSequentialMLP``: 'grouped' always,
    'loop' never, 'auto' on CPU (where it is bitwise the loop), if torch has the kernel."""
    one_of("trainer.expert_gemm", expert_gemm, EXPERT_GEMMS)
    wanted = expert_gemm == "grouped" or (expert_gemm == "auto" and not has_cuda)
    return wanted and grouped_mm_fn() is not None


def _plain_linear(module: Any) -> bool:
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    return (
        type(module) in (ColumnParallelLinear, RowParallelLinear)
        and getattr(module, "bias", None) is None
        and not module._forward_hooks
        and not module._forward_pre_hooks
    )


def _aligned(dtype: torch.dtype, *sizes: int) -> bool:
    """The grouped kernel wants every row stride a multiple of 16 bytes."""
    return all((size * dtype.itemsize) % 16 == 0 for size in sizes)


NATIVE_BACKWARD_MAX_WEIGHT = 8192
"""Experts' weights of at most this many elements take torch's own grouped backward
(measured on 2 CPU cores: 0.35 ms against 0.59 for 8 experts of 64×64, where the
per-expert weight-gradient loop is mostly overhead); larger ones take ``GroupedLinear``'s
(torch's was 0.2 s against 0.03 s for 16 experts of 512×512)."""


def grouped_linear(
    x: torch.Tensor, offs: torch.Tensor, counts: list[int], weights: list[torch.Tensor]
) -> torch.Tensor:
    """``x[g] @ W[g]ᵀ`` for every group of rows, with the faster backward for the size."""
    if weights[0].numel() > NATIVE_BACKWARD_MAX_WEIGHT:
        return GroupedLinear.apply(x, offs, counts, *weights)  # type: ignore[no-any-return]
    out = grouped_mm_fn()(x, torch.stack(weights).transpose(1, 2), offs=offs)
    if out.requires_grad:  # torch's grouped backward refuses a broadcast (stride-0) gradient
        out.register_hook(lambda grad: grad.contiguous())
    return out  # type: ignore[no-any-return]


class GroupedLinear(torch.autograd.Function):
    """``y[g] = x[g] @ W[g]ᵀ`` for every group ``g`` of rows (``counts``): the forward and
    the input gradient as grouped GEMMs, the weight gradients as one plain GEMM per
    expert (``dW[g] = dy[g]ᵀ @ x[g]``, as megatron-core's linear computes it). torch's
    own grouped backward computes the weight gradients far slower on CPU at mid sizes
    (0.2 s against 0.03 s for 16 experts of 512×512). The weights are stacked again for
    backward rather than kept stacked, so no copy of them lives between the passes."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, offs: torch.Tensor, counts: list[int], *weights: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(x, offs, *weights)  # the parameters, not their stacked copy
        ctx.counts = counts
        stacked = torch.stack(weights)  # [E, out, in]
        return grouped_mm_fn()(x, stacked.transpose(1, 2), offs=offs)  # type: ignore[no-any-return]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, offs, *weights = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = grouped_mm_fn()(grad, torch.stack(weights), offs=offs)
        grad_ws = [
            g.t().matmul(rows) if need else None
            for g, rows, need in zip(
                torch.split(grad, ctx.counts), torch.split(x, ctx.counts), ctx.needs_input_grad[3:]
            )
        ]
        return (grad_x, None, None, *grad_ws)


class GroupedSequentialMLP(SequentialMLP):
    """``SequentialMLP`` whose forward runs its experts as two grouped GEMMs when it can
    (module docstring); same parameters, same results."""

    def grouped_ok(self, hidden: torch.Tensor) -> bool:
        """Whether this forward can take the grouped path (else the loop)."""
        cfg = self.config
        if self.num_local_experts < 2 or cfg.moe_apply_probs_on_input:
            return False
        if cfg.fp8 or getattr(cfg, "fp4", None) or cfg.bias_activation_fusion:
            return False
        if cfg.use_te_activation_func or not cfg.gated_linear_unit:
            return False
        if self._forward_hooks or self._forward_pre_hooks:
            return False
        if hidden.is_cuda and hidden.dtype != torch.bfloat16:
            return False
        for expert in self.local_experts:
            if expert._forward_hooks or expert._forward_pre_hooks:
                return False
            if not (_plain_linear(expert.linear_fc1) and _plain_linear(expert.linear_fc2)):
                return False
        fc1 = self.local_experts[0].linear_fc1.weight  # [2·ffn, hidden]
        return (
            fc1.dtype == hidden.dtype
            and hidden.is_contiguous()
            and hidden.data_ptr() % 16 == 0
            and _aligned(hidden.dtype, fc1.shape[0], fc1.shape[1], fc1.shape[0] // 2)
        )

    def forward(
        self,
        permuted_local_hidden_states: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        permuted_probs: torch.Tensor,
    ) -> tuple[torch.Tensor, None]:
        hidden = permuted_local_hidden_states
        if not self.grouped_ok(hidden):
            return super().forward(hidden, tokens_per_expert, permuted_probs)  # type: ignore[no-any-return]
        cfg = self.config
        counts = [int(n) for n in torch.as_tensor(tokens_per_expert).tolist()]
        offs = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(hidden.device, torch.int32)
        fc1 = [e.linear_fc1.weight for e in self.local_experts]
        inter = grouped_linear(hidden, offs, counts, fc1)
        gate, linear = torch.chunk(inter, 2, dim=-1)
        if (clamp := cfg.activation_func_clamp_value) is not None:
            gate = gate.clamp(min=None, max=clamp)
            linear = linear.clamp(min=-clamp, max=clamp)
        inter = cfg.activation_func(gate) * (linear + cfg.glu_linear_offset)
        inter = (inter * permuted_probs.unsqueeze(-1)).to(inter.dtype)
        fc2 = [e.linear_fc2.weight for e in self.local_experts]
        return grouped_linear(inter, offs, counts, fc2), None
