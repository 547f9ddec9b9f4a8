"""Logprobs straight from the last hidden states: the output layer never returns logits.

With ``trainer.logprobs_from=hidden`` the last pipeline stage's ``output_layer`` computes
each token's log p(label) with ``moerl.kernels.logprob.fused_logprobs`` (Triton on GPU:
the [tokens × vocab] logits exist only block by block; the torch twin on CPU) and returns
them as a [S, B, 1] "logits" tensor, which megatron-core's GPTModel hands back as
[B, S, 1]. The micro-batch's labels, temperatures and sampling-mask kept sets are set
before each forward (``set_microbatch``); ``logprobs_of`` reads either kind of output.

The output layer's tensor-parallel contract is kept: its input is gathered along the
sequence under sequence parallelism (reduce-scatter of d hidden in backward), or
all-reduced in backward otherwise, exactly as ColumnParallelLinear does. A LoRA adapter
on ``lm_head`` is folded in rather than added to logits: logits = h Wᵀ + s·(h Aᵀ) Bᵀ =
[h, s·h Aᵀ] · [W, B]ᵀ, one fused pass over a weight r columns wider.
"""

# B sequences per micro-batch, S padded length, H hidden, Vl this rank's vocabulary
# shard, r LoRA rank, T = S·B tokens in megatron's sequence-major order

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from moerl.common.checks import one_of
from moerl.trainer import numerics
from moerl.trainer.batch import MicroBatch
from moerl.trainer.logprobs import token_logprobs

SOURCES = ("auto", "logits", "hidden")


def resolve_source(source: str) -> str:
    """'auto' → 'hidden' where the fused kernel runs (CUDA with Triton), else 'logits'
    (on CPU the twin would build the full logits anyway)."""
    one_of("trainer.logprobs_from", source, SOURCES)
    if source != "auto":
        return source
    from moerl.device import has_cuda
    from moerl.kernels.dispatch import get_backend, triton_available

    return "hidden" if has_cuda() and triton_available() and get_backend() != "torch" else "logits"


class FusedHead:
    """Replaces ``output_layer.forward`` of every last-stage chunk until ``remove()``."""

    def __init__(self, modules: list[Any], use_mask: bool) -> None:
        self.use_mask = use_mask
        self.mb: MicroBatch | None = None
        self._installed: list[Any] = []
        for module in modules:
            layer = getattr(module, "output_layer", None)
            if layer is None or not getattr(module, "post_process", False):
                continue
            if getattr(layer, "gather_output", False):
                raise NotImplementedError("trainer.logprobs_from=hidden with gather_output=True")
            lora = _head_adapter(module)
            if lora is not None:
                if lora.dropout:
                    raise ValueError(
                        f"trainer.logprobs_from=hidden folds the lm_head adapter into the "
                        f"fused head, which has no adapter dropout (lora.dropout={lora.dropout}); "
                        "use lora.dropout=0 or trainer.logprobs_from=logits"
                    )
                lora.folded = True  # its hook stands aside; forward() adds it instead
            layer.forward = self._forward(layer, lora)
            self._installed.append((layer, lora))

    def set_microbatch(self, mb: MicroBatch) -> None:
        self.mb = mb

    def remove(self) -> None:
        for layer, lora in self._installed:
            del layer.forward  # back to the class's forward
            if lora is not None:
                lora.folded = False
        self._installed = []

    def _forward(self, layer: Any, lora: Any):  # type: ignore[no-untyped-def]
        def forward(input_: torch.Tensor, weight: torch.Tensor | None = None, **_kwargs: Any):  # type: ignore[no-untyped-def]
            from megatron.core.tensor_parallel.mappings import (
                gather_from_sequence_parallel_region,
            )

            from moerl.kernels.logprob import fused_logprobs

            mb = self.mb
            if mb is None:
                raise RuntimeError("FusedHead: set_microbatch() before the forward")
            group = layer.tp_group
            tp = torch.distributed.get_world_size(group) if group is not None else 1
            sequence_parallel = bool(layer.sequence_parallel) and tp > 1
            h_SBH = input_
            if sequence_parallel:
                h_SBH = gather_from_sequence_parallel_region(
                    h_SBH, tensor_parallel_output_grad=True, group=group
                )
            s, b, _ = h_SBH.shape
            h_TH = h_SBH.reshape(s * b, -1)
            w_VlH = weight if weight is not None else layer.weight
            if lora is not None:  # [h, s·h Aᵀ] · [W, B]ᵀ = h Wᵀ + s·(h Aᵀ) Bᵀ
                a_rH = lora._copy(lora.lora_A[0]) if sequence_parallel else lora.lora_A[0]
                h_TH = torch.cat([h_TH, F.linear(h_TH, a_rH) * lora.scaling], dim=-1)
                w_VlH = torch.cat([w_VlH, lora.lora_B[0]], dim=-1)
            labels_T, temp_T, pos_N, ids_N = _sequence_major(mb, self.use_mask)
            lp_T, _ = fused_logprobs(
                h_TH, w_VlH.to(h_TH.dtype), labels_T.to(h_TH.device), temp_T.to(h_TH.device),
                mask_pos_N=pos_N, mask_ids_N=ids_N, tp_group=group if tp > 1 else None,
                reduce_grad_hidden=not sequence_parallel,
            )  # fmt: skip
            return lp_T.reshape(s, b, 1), None

        return forward


def _head_adapter(module: Any) -> Any:
    """The LoRA adapter on this chunk's output layer, or None."""
    holder = getattr(module, "lora", None)
    if holder is None or "lm_head" not in holder.adapters:
        return None
    return holder.adapters["lm_head"]


def _sequence_major(mb: MicroBatch, use_mask: bool):  # type: ignore[no-untyped-def]
    """The micro-batch's per-token inputs in megatron's [S, B] token order."""
    b, s = mb.labels.shape
    labels_T = mb.labels.t().reshape(-1)
    temp_T = mb.temperature.reshape(b, s).t().reshape(-1)
    if not use_mask or mb.mask_pos is None or mb.mask_ids is None:
        return labels_T, temp_T, None, None
    row, col = mb.mask_pos // s, mb.mask_pos % s
    return labels_T, temp_T, col * b + row, mb.mask_ids


def logprobs_of(
    mb: MicroBatch, output_BSx: torch.Tensor, use_mask: bool, fused: bool
) -> torch.Tensor:
    """[B, S] log p(label) of a micro-batch from the model's output: the fused head's
    logprobs ([B, S, 1], ``fused``) as they are, or logits ([B, S, Vl]) through
    ``token_logprobs``."""
    b, s, v = output_BSx.shape
    if fused:
        assert v == 1, f"the fused head returns [B, S, 1], got {tuple(output_BSx.shape)}"
        return output_BSx[..., 0]
    # trainer.numerics=batch_invariant: the engine's formulas (moerl/trainer/numerics.py)
    compute = numerics.token_logprobs if numerics.matched(output_BSx) else token_logprobs
    return compute(
        output_BSx.reshape(b * s, v), mb.labels.reshape(-1), mb.temperature,
        mask_pos_N=mb.mask_pos if use_mask else None, mask_ids_N=mb.mask_ids if use_mask else None,
    ).reshape(b, s)  # fmt: skip
