"""Process groups: torch.distributed init and megatron-core's parallel state."""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

from moerl import compat, device
from moerl.config.parallel import ParallelConfig


def init_process_group(backend: str | None = None, timeout_s: float = 600.0) -> None:
    """Join the default process group from torchrun-style env vars (idempotent).

    Activates ``moerl.compat`` first when CUDA is absent.
    """
    compat.activate()
    if dist.is_initialized():
        return
    missing = [
        k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ
    ]
    if missing:
        raise RuntimeError(
            f"environment variables {missing} are not set: start under torchrun, "
            "or use moerl.parallel.spawn for local processes"
        )
    device.bind_local_device()
    dist.init_process_group(
        backend=backend or device.default_backend(),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timedelta(seconds=timeout_s),
    )


def initialize_model_parallel(
    cfg: ParallelConfig,
    *,
    num_layers: int,
    num_attention_heads: int,
    num_query_groups: int | None = None,
    num_experts: int | None = None,
    seed: int = 1234,
) -> None:
    """Validate the layout against the world and the model, build megatron-core's groups,
    and seed its RNG tracker (model-, data- and expert-parallel streams) from ``seed``."""
    from megatron.core import parallel_state

    world = dist.get_world_size()
    cfg.validate(
        world,
        num_layers=num_layers,
        num_attention_heads=num_attention_heads,
        num_query_groups=num_query_groups,
        num_experts=num_experts,
    )
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=cfg.tp,
        pipeline_model_parallel_size=cfg.pp,
        virtual_pipeline_model_parallel_size=cfg.virtual_pp,
        expert_model_parallel_size=cfg.ep,
        expert_tensor_parallel_size=cfg.expert_tp,
        create_gloo_process_groups=not device.has_cuda(),
    )
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(seed)


def initialize_for_model(cfg: ParallelConfig, model: object, seed: int = 1234) -> None:
    """``initialize_model_parallel`` with the sizes of a ``ModelConfig``."""
    initialize_model_parallel(
        cfg,
        num_layers=model.num_layers,  # type: ignore[attr-defined]
        num_attention_heads=model.num_attention_heads,  # type: ignore[attr-defined]
        num_query_groups=model.num_query_groups,  # type: ignore[attr-defined]
        num_experts=model.num_experts,  # type: ignore[attr-defined]
        seed=seed,
    )


def destroy() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
