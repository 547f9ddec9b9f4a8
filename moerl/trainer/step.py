"""One optimizer step over micro-batches with megatron-core's pipeline schedules."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class StepResult:
    loss: float | None  # mean over micro-batches and DP ranks; None off the last stage
    grad_norm: float | None
    update_successful: bool


def _dp_mean_loss(losses: list[dict[str, torch.Tensor]], key: str) -> float | None:
    """Average the last stage's per-micro-batch losses over DP (None on other stages)."""
    from megatron.core import parallel_state

    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return None
    local = torch.stack([d[key].detach().float() for d in losses]).mean() if losses else None
    if local is None:
        return None
    dp_group = parallel_state.get_data_parallel_group()
    if dist.get_world_size(dp_group) > 1:
        dist.all_reduce(local, group=dp_group)
        local = local / dist.get_world_size(dp_group)
    return float(local.item())


def run_microbatches(
    chunks: list[Any],
    forward_step: Callable[[Iterator[Any], Any], Any],
    microbatches: list[Any],
    *,
    seq_length: int,
    micro_batch_size: int,
    forward_only: bool,
    head: Any = None,
) -> list[Any]:
    """megatron-core's schedule over ``microbatches`` (every model chunk reads them in
    order); a ``moerl.trainer.fused_head.FusedHead`` given as ``head`` is removed after,
    whatever happens. Returns the schedule's per-micro-batch outputs."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    data = [iter(microbatches) for _ in chunks] if len(chunks) > 1 else iter(microbatches)
    try:
        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=data,
            model=chunks,
            num_microbatches=len(microbatches),
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            forward_only=forward_only,
        )
    finally:
        if head is not None:
            head.remove()


def train_step(
    chunks: list[Any],
    optimizer: Any,
    forward_step: Callable[[Iterator[Any], Any], Any],
    data: list[Iterator[Any]] | Iterator[Any],
    *,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    loss_key: str = "loss",
    step: bool = True,
) -> StepResult:
    """Forward/backward over ``num_microbatches`` micro-batches, then one optimizer step.

    ``forward_step(data_iterator, model)`` follows megatron-core's contract: it
    returns ``(output_tensor, loss_func)`` and ``loss_func(output_tensor)``
    returns ``(loss, {loss_key: loss})``.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=data,
        model=chunks,
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=False,
    )
    loss = _dp_mean_loss(losses, loss_key)
    if not step:
        return StepResult(loss=loss, grad_norm=None, update_successful=False)
    ok, grad_norm, _ = optimizer.step()
    return StepResult(loss=loss, grad_norm=grad_norm, update_successful=bool(ok))
