"""Parallel-layout parity: every TP/PP/EP/ETP/DP layout against the single process.

The reference run (one process) builds a tiny MoE model, takes one optimizer step
and saves its initial weights, loss, full gradients and updated weights. Each
layout then starts from exactly those weights (``full_state.load_full``), runs the
same global batch through megatron-core's schedules, DDP and optimizer, gathers
gradients and weights back to full shape and compares them with the reference.
Used by ``tools/check_parallel.py`` and ``tests/dist``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from moerl.config.model import ModelConfig
from moerl.parallel.full_state import allgather_sharded_grads, gather_full, load_full
from moerl.parallel.layout import parse_layout
from moerl.parallel.spawn import spawn

FP32_TOL = 1e-5
# Adam's first step moves each weight by about ±lr whatever the gradient's size, so a
# near-zero gradient whose sign differs in the last bit between layouts moves a weight
# by 2·lr: post-step weights amplify fp32 reduction-order noise. Loss and gradients
# keep the 1e-5 bound; the weights after the step get 1e-4.
PARAM_TOL = 1e-4


def tiny_moe() -> ModelConfig:
    """≥ 2 MoE layers, 4 experts, top-2, a shared expert, GQA, and one dense layer first."""
    return ModelConfig(
        family="gpt",
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=128,
        vocab_size=128,
        max_position_embeddings=64,
        num_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=32,
        moe_shared_expert_intermediate_size=32,
        normalization="RMSNorm",
        seq_length=16,
    )


@dataclass
class ParityConfig:
    model: ModelConfig = field(default_factory=tiny_moe)
    global_batch: int = 8
    """Sequences per optimizer step, split over data-parallel ranks."""
    micro_batch_size: int = 1
    seed: int = 1234
    lr: float = 1e-3
    use_distributed_optimizer: bool = True
    first_k_dense: int = 1
    aux_loss_coeff: float = 1e-2
    dispatcher: str = "alltoall"
    """megatron-core MoE token dispatcher: 'alltoall' or 'allgather'."""


@dataclass
class ParityResult:
    layout: str
    world_size: int
    loss_rel_err: float
    grad_rel_err: float
    param_rel_err: float
    loss2_rel_err: float
    replica_max_abs_diff: float
    worst_grad: str
    tol: float = FP32_TOL
    param_tol: float = PARAM_TOL
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        errs = (self.loss_rel_err, self.grad_rel_err, self.loss2_rel_err)
        within = all(math.isfinite(e) and e <= self.tol for e in errs)
        return within and self.param_rel_err <= self.param_tol and not self.notes

    def line(self) -> str:
        status = "ok" if self.ok else "FAIL"
        text = (
            f"layout={self.layout} loss_rel_err={self.loss_rel_err:.2e} "
            f"grad_rel_err={self.grad_rel_err:.2e} param_rel_err={self.param_rel_err:.2e} "
            f"loss2_rel_err={self.loss2_rel_err:.2e} world={self.world_size} {status}"
        )
        if not self.ok:
            text += f" (worst grad: {self.worst_grad}; " + "; ".join(self.notes) + ")"
        return text


def _batch(cfg: ParityConfig) -> torch.Tensor:
    gen = torch.Generator().manual_seed(cfg.seed)
    return torch.randint(
        0, cfg.model.vocab_size, (cfg.global_batch, cfg.model.seq_length + 1), generator=gen
    )


def _microbatches(cfg: ParityConfig) -> tuple[list[dict[str, torch.Tensor]], int]:
    from megatron.core import parallel_state

    dp = parallel_state.get_data_parallel_world_size()
    dp_rank = parallel_state.get_data_parallel_rank()
    if cfg.global_batch % (dp * cfg.micro_batch_size):
        raise ValueError(
            f"global_batch={cfg.global_batch} must be divisible by dp × micro_batch_size = "
            f"{dp} × {cfg.micro_batch_size}"
        )
    per_rank = cfg.global_batch // dp
    tokens = _batch(cfg)[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    seq = cfg.model.seq_length
    position_ids = torch.arange(seq).unsqueeze(0).expand(cfg.micro_batch_size, seq)
    mbs = [
        {
            "tokens": tokens[i : i + cfg.micro_batch_size, :-1].contiguous(),
            "labels": tokens[i : i + cfg.micro_batch_size, 1:].contiguous(),
            "position_ids": position_ids,
        }
        for i in range(0, per_rank, cfg.micro_batch_size)
    ]
    return mbs, len(mbs)


def _loss_func(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = output.float().mean()
    # clone: megatron-core divides the returned loss by num_microbatches in place.
    return loss, {"loss": loss.detach().clone()}


def _forward_step(data: Iterator[dict[str, torch.Tensor]], model: Any) -> tuple[Any, Any]:
    batch = next(data)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, _loss_func


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    denom = b.norm().item()
    diff = (a - b).norm().item()
    return diff / denom if denom > 0 else diff


def _max_rel_err(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> tuple[float, str]:
    worst, name = 0.0, ""
    for key, ref_t in ref.items():
        err = _rel_err(got[key], ref_t) if key in got else float("inf")
        if err > worst or math.isnan(err):
            worst, name = err, key
    return worst, name


def _run(layout: str, workdir: str, cfg_dict: dict[str, Any]) -> None:
    """Body of every rank (the reference is layout 'single')."""
    from moerl.models.gpt import build_model
    from moerl.parallel.state import initialize_model_parallel
    from moerl.trainer.step import train_step
    from moerl.trainer.wrap import OptimConfig, attach_schedule_hooks, build_optimizer, wrap_ddp

    cfg = ParityConfig(model=ModelConfig(**cfg_dict.pop("model")), **cfg_dict)
    model = cfg.model
    model.first_k_dense_replace = cfg.first_k_dense
    model.moe_aux_loss_coeff = cfg.aux_loss_coeff
    model.moe_token_dispatcher_type = cfg.dispatcher
    pcfg, _ = parse_layout(layout)
    initialize_model_parallel(
        pcfg,
        num_layers=model.num_layers,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        num_experts=model.num_experts,
        seed=cfg.seed,
    )
    chunks = build_model(model, pcfg)
    out = Path(workdir)
    is_ref = layout == "single"
    rank0 = dist.get_rank() == 0
    if is_ref:
        init = gather_full(chunks, "param")
        assert init is not None
        save_file(init.tensors, str(out / "init.safetensors"))
    else:
        load_full(chunks, load_file(str(out / "init.safetensors")))

    ddp = wrap_ddp(chunks, cfg.use_distributed_optimizer)
    optimizer = build_optimizer(
        ddp, OptimConfig(lr=cfg.lr, use_distributed_optimizer=cfg.use_distributed_optimizer)
    )
    attach_schedule_hooks(ddp, optimizer)
    modules = [c.module for c in ddp]

    def forward_backward() -> float | None:
        mbs, n = _microbatches(cfg)
        data = [iter(mbs) for _ in ddp] if len(ddp) > 1 else iter(mbs)
        res = train_step(
            ddp,
            optimizer,
            _forward_step,
            data,
            num_microbatches=n,
            seq_length=model.seq_length,
            micro_batch_size=cfg.micro_batch_size,
            step=False,
        )
        return res.loss

    loss1 = forward_backward()
    if cfg.use_distributed_optimizer:
        # The step below only needs each rank's shard; it reads main_grad views of the
        # buffer, so refilling the other shards with their reduced values changes nothing.
        allgather_sharded_grads(ddp)
    grads = gather_full(modules, "grad")
    ok, _, _ = optimizer.step()
    params = gather_full(modules, "param")
    loss2 = forward_backward()

    # The loss lives on the last pipeline stage; bring it to rank 0.
    losses: list[Any] = [None] * dist.get_world_size() if rank0 else []
    dist.gather_object((loss1, loss2), losses if rank0 else None, dst=0)
    if not rank0:
        return
    assert grads is not None and params is not None
    loss1, loss2 = next(item for item in losses if item[0] is not None)
    if is_ref:
        save_file(grads.tensors, str(out / "grads.safetensors"))
        save_file(params.tensors, str(out / "params.safetensors"))
        (out / "losses.json").write_text(json.dumps({"loss1": loss1, "loss2": loss2}))
        return
    ref_losses = json.loads((out / "losses.json").read_text())
    grad_err, worst = _max_rel_err(grads.tensors, load_file(str(out / "grads.safetensors")))
    param_err, _ = _max_rel_err(params.tensors, load_file(str(out / "params.safetensors")))
    notes = []
    if grads.uncovered or params.uncovered:
        notes.append(f"uncovered tensors {sorted(set(grads.uncovered + params.uncovered))[:3]}")
    if not ok:
        notes.append("optimizer step reported failure")
    result = ParityResult(
        layout=layout,
        world_size=dist.get_world_size(),
        loss_rel_err=abs(loss1 - ref_losses["loss1"]) / abs(ref_losses["loss1"]),
        grad_rel_err=grad_err,
        param_rel_err=param_err,
        loss2_rel_err=abs(loss2 - ref_losses["loss2"]) / abs(ref_losses["loss2"]),
        replica_max_abs_diff=max(grads.replica_max_abs_diff, params.replica_max_abs_diff),
        worst_grad=worst,
        notes=notes,
    )
    if result.replica_max_abs_diff > FP32_TOL:
        result.notes.append(f"replicas disagree by {result.replica_max_abs_diff:.2e}")
    (out / f"result_{layout}.json").write_text(json.dumps(asdict(result)))


def run_reference(workdir: str | Path, cfg: ParityConfig) -> None:
    spawn(_run, 1, "single", str(workdir), asdict(cfg))


def run_layout(layout: str, workdir: str | Path, cfg: ParityConfig) -> ParityResult:
    """Run one layout against the reference already in ``workdir``."""
    _, world = parse_layout(layout)
    spawn(_run, world, layout, str(workdir), asdict(cfg))
    data = json.loads((Path(workdir) / f"result_{layout}.json").read_text())
    return ParityResult(**data)
