"""Wrap model chunks in megatron-core DDP and build its optimizer.

The same code runs on gloo (CPU, via ``moerl.compat``) and NCCL. Gradient
reduction happens in fp32 buffers; with ``use_distributed_optimizer`` the
optimizer state and the gradient reduce-scatter are sharded over data parallel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moerl.config.trainer import CPU_ADAMS


@dataclass
class OptimConfig:
    """The subset of megatron-core's OptimizerConfig moerl exposes."""

    lr: float = 1e-3
    """Peak learning rate (the lr until a scheduler from ``moerl.trainer.schedule`` sets it)."""
    min_lr: float = 0.0
    """The floor a decaying schedule reaches (megatron keeps it on every param group)."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip over all parameters and ranks (0 disables)."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state and reduce-scatter gradients over data parallel."""
    cpu_adam: str = "fused"
    """torch's AdamW implementation for CPU parameters: 'fused', 'foreach' or 'for_loop'
    (TrainerConfig.cpu_adam)."""


def wrap_ddp(
    chunks: list[torch.nn.Module], use_distributed_optimizer: bool, bucket_size: int | None = None
) -> list[Any]:
    """megatron-core DDP around every chunk (fp32 grad buffers, no comm overlap)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from moerl.models.spec import have_transformer_engine

    config: Any = chunks[0].config  # megatron-core TransformerConfig (untyped)
    if (
        config.multi_latent_attention
        and config.tensor_model_parallel_size > 1
        and not have_transformer_engine()
    ):
        # Found by tests/dist/test_rl_step.py: forward logits match the single process,
        # but the down-projection gradients of megatron-core 0.16's local MLA path are
        # ~0.5% off under TP (its gather of the compressed KV only splits the gradient).
        raise ValueError(
            f"training an MLA model with parallel.tp={config.tensor_model_parallel_size} needs "
            "transformer-engine (megatron-core's local MLA computes wrong gradients under "
            "tensor parallelism); use parallel.tp=1 with ep/etp/pp, or install moerl[te]"
        )
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer,
        bucket_size=bucket_size,
    )
    wrapped = []
    for i, chunk in enumerate(chunks):
        wrapped.append(
            DistributedDataParallel(
                config=chunk.config,
                ddp_config=ddp_config,
                module=chunk,
                # Only the first chunk buckets: megatron-core's own convention for VPP.
                disable_bucketing=i > 0,
            )
        )
    return wrapped


def build_optimizer(chunks: list[Any], cfg: OptimConfig) -> Any:
    """megatron-core's optimizer (AdamW) over DDP-wrapped chunks; dtype follows the model.

    Its ``step()`` returns ``(success, grad_norm, num_zeros)``. megatron-core 0.16 always
    wraps it in a ChainedOptimizer (dense and expert parameters), whose step computes
    ``grad_norm`` (the global L2 norm over every rank, TP duplicates counted once) before
    it clips, so ``grad_norm`` is the pre-clip norm, also with ``clip_grad=0``; clipping
    then scales the gradients by ``clip_grad / (grad_norm + 1e-6)`` when that is below 1.
    Weight decay is not applied per group until a scheduler sets each group's rate
    (``moerl.trainer.schedule.build_scheduler``); without one, every group decays.
    """
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from moerl.device import has_cuda

    model_config = chunks[0].config
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=cfg.lr,
        min_lr=cfg.min_lr,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1,
        adam_beta2=cfg.adam_beta2,
        adam_eps=cfg.adam_eps,
        clip_grad=cfg.clip_grad,
        use_distributed_optimizer=cfg.use_distributed_optimizer,
        params_dtype=model_config.params_dtype,
        bf16=model_config.bf16,
        fp16=model_config.fp16,
    )
    # gloo groups exist exactly where moerl.parallel.state made them (without CUDA)
    optimizer = get_megatron_optimizer(opt_config, chunks, use_gloo_process_groups=not has_cuda())
    if not has_cuda():
        choose_cpu_adam(optimizer, cfg.cpu_adam)
    return optimizer


def choose_cpu_adam(optimizer: Any, impl: str) -> int:
    """Set every torch Adam/AdamW inside megatron-core's ``optimizer`` whose parameters are
    all on the CPU to ``impl`` ('fused', 'foreach' or 'for_loop'), through the flags its
    ``step`` reads from each param group; returns how many param groups changed."""
    if impl not in CPU_ADAMS:
        raise ValueError(f"cpu_adam={impl!r}: choose one of {', '.join(map(repr, CPU_ADAMS))}")
    changed = 0
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_opt = getattr(inner, "optimizer", None)
        if not isinstance(torch_opt, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in torch_opt.param_groups:
            if any(p.device.type != "cpu" for p in group["params"]):
                continue
            group["fused"] = impl == "fused"
            group["foreach"] = impl == "foreach"
            changed += 1
    return changed


def attach_schedule_hooks(chunks: list[Any], optimizer: Any) -> None:
    """Give the model config the hooks megatron-core's schedules call (as Megatron-LM does)."""
    from megatron.core.distributed import finalize_model_grads

    config = chunks[0].config
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    no_sync = [c.no_sync for c in chunks]
    config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
