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
from functools import partial
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
# The weights after the step are held to the same bound. The check uses Adam with
# eps=1e-6 (ParityConfig.adam_eps): with 1e-8, Adam's first step moves each weight by
# ~±lr however small its gradient, so a near-zero gradient whose sign differs in the
# last bit between layouts would move a weight by 2·lr.
PARAM_TOL = FP32_TOL


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
    adam_eps: float = 1e-6
    """Large enough that near-zero gradients take near-zero steps (with 1e-8, Adam moves
    every weight by ±lr whatever its gradient, amplifying last-bit differences)."""
    use_distributed_optimizer: bool = True
    first_k_dense: int = 1
    aux_loss_coeff: float = 1e-2
    dispatcher: str = "alltoall"
    """megatron-core MoE token dispatcher: 'alltoall' or 'allgather'."""
    replay: bool = False
    """Keep Routing: replay routes recorded by the reference model on another batch."""


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


def _microbatches(
    cfg: ParityConfig, routes: torch.Tensor | None = None
) -> tuple[list[dict[str, torch.Tensor]], int]:
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
    if routes is not None:
        mine = routes[dp_rank * per_rank : (dp_rank + 1) * per_rank]
        for j, mb in enumerate(mbs):
            mb["routes"] = mine[j * cfg.micro_batch_size : (j + 1) * cfg.micro_batch_size]
    return mbs, len(mbs)


def _record_routes(chunks: list[Any], cfg: ParityConfig) -> torch.Tensor:
    """Routes [G, S, L, K] that the (single-process) reference model chooses on a
    different batch: real router decisions that differ from the ones the training batch
    would get, so replaying them changes the forward."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from moerl.trainer.replay import RoutingReplay

    replayer = RoutingReplay(chunks, policy="none")
    model = cfg.model
    k = model.moe_router_topk
    seq = model.seq_length
    rolled = torch.roll(_batch(cfg), shifts=7, dims=0).flip(1)
    routes = torch.arange(k).expand(cfg.global_batch, seq, model.num_layers, k).clone()
    with torch.no_grad():
        for g in range(cfg.global_batch):
            for inst in replayer.layers[0].values():
                inst.set_router_replay_action(RouterReplayAction.RECORD)
            tokens = rolled[g : g + 1, :-1]
            chunks[0](tokens, torch.arange(seq)[None], None)
            for number, inst in replayer.layers[0].items():
                routes[g, :, number - 1] = inst.get_recorded_indices().view(seq, k)
                inst.clear_indices()
                inst.clear_router_replay_action()
    return routes


def _loss_func(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = output.float().mean()
    # clone: megatron-core divides the returned loss by num_microbatches in place.
    return loss, {"loss": loss.detach().clone()}


def _forward_step(
    replayer: Any, chunk_of: dict[int, int], data: Iterator[dict[str, torch.Tensor]], model: Any
) -> tuple[Any, Any]:
    batch = next(data)
    if replayer is not None:
        replayer.set_microbatch(chunk_of[id(model)], batch["routes"])
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
    chunks = build_model(model, pcfg, routing_replay=cfg.replay)
    out = Path(workdir)
    is_ref = layout == "single"
    rank0 = dist.get_rank() == 0
    routes = replayer = None
    if cfg.replay:
        from moerl.trainer.replay import RoutingReplay

        if is_ref:
            routes = _record_routes(chunks, cfg)
            save_file({"routes": routes}, str(out / "routes.safetensors"))
        else:
            routes = load_file(str(out / "routes.safetensors"))["routes"]
        replayer = RoutingReplay(chunks, policy="all")
    if is_ref:
        init = gather_full(chunks, "param")
        assert init is not None
        save_file(init.tensors, str(out / "init.safetensors"))
    else:
        load_full(chunks, load_file(str(out / "init.safetensors")))

    ddp = wrap_ddp(chunks, cfg.use_distributed_optimizer)
    optimizer = build_optimizer(
        ddp,
        OptimConfig(
            lr=cfg.lr,
            adam_eps=cfg.adam_eps,
            use_distributed_optimizer=cfg.use_distributed_optimizer,
        ),
    )
    attach_schedule_hooks(ddp, optimizer)
    modules = [c.module for c in ddp]

    chunk_of = {id(c): i for i, c in enumerate(ddp)}

    def forward_backward() -> float | None:
        mbs, n = _microbatches(cfg, routes)
        data = [iter(mbs) for _ in ddp] if len(ddp) > 1 else iter(mbs)
        res = train_step(
            ddp,
            optimizer,
            partial(_forward_step, replayer, chunk_of),
            data,
            num_microbatches=n,
            seq_length=model.seq_length,
            micro_batch_size=cfg.micro_batch_size,
            step=False,
        )
        if replayer is not None:
            replayer.finish()  # also checks every target was consumed exactly once
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
