"""The optimizer as configured: megatron-core's clipping reports the pre-clip global norm
and steps with the clipped gradient, and the Trainer's lr schedule resumes where it
stopped (also when the resumed config changes the lr)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from moerl.parallel import parse_layout, spawn

LR, EPS, NORM = 1.0e-2, 1.0, 10.0


def _tiny_ddp(layout: str) -> tuple[list, list[torch.Tensor], bool]:
    """The tiny Qwen3-MoE model in ``layout``, wrapped in megatron DDP: (chunks, their
    parameters, whether data parallelism shards the optimizer)."""
    from moerl.models.gpt import build_model
    from moerl.models.tiny import tiny_config
    from moerl.parallel.state import initialize_for_model
    from moerl.trainer.wrap import wrap_ddp

    model = tiny_config("qwen3_moe")
    pcfg, _ = parse_layout(layout)
    initialize_for_model(pcfg, model, seed=7)
    distributed = pcfg.dp(dist.get_world_size()) > 1
    ddp = wrap_ddp(build_model(model, pcfg), use_distributed_optimizer=distributed)
    return ddp, [p for c in ddp for p in c.module.parameters()], distributed


def _clip(layout: str, out: str) -> None:
    from moerl.trainer.wrap import OptimConfig, build_optimizer

    ddp, params, distributed = _tiny_ddp(layout)
    # the same hand gradient on every rank (as after DDP's all-reduce), global norm NORM
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(p.shape, generator=gen) for p in params]
    scale = NORM / torch.sqrt(sum((g.double() ** 2).sum() for g in grads))
    grads = [(g.double() * scale).float() for g in grads]
    record = {}
    for clip in (1.0, 0.0):
        # Adam's first update is lr × g / (|g| + eps): sign-like for a tiny eps, so eps = 1
        # (~|g|) makes it depend on the gradient's size, clipped or not.
        optimizer = build_optimizer(
            ddp,
            OptimConfig(lr=LR, adam_eps=EPS, clip_grad=clip, use_distributed_optimizer=distributed),
        )
        before = [p.detach().clone() for p in params]
        for c in ddp:
            c.zero_grad_buffer()
        optimizer.zero_grad()
        for p, g in zip(params, grads):
            p.main_grad.copy_(g)
        ok, grad_norm, _ = optimizer.step()
        assert ok
        used = [g * (clip / (NORM + 1e-6)) for g in grads] if clip else grads
        want = [b - LR * u / (u.abs() + EPS) for b, u in zip(before, used)]
        err = max(float((p.detach() - w).abs().max()) for p, w in zip(params, want))
        moved = max(float((p.detach() - b).abs().max()) for p, b in zip(params, before))
        record[str(clip)] = {"grad_norm": float(grad_norm), "err": err, "moved": moved}
        with torch.no_grad():
            for p, b in zip(params, before):
                p.copy_(b)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(record))


@pytest.mark.parametrize("layout", ["single", "dp2"])
def test_clip_reports_preclip_norm_and_steps_clipped(layout: str, tmp_path) -> None:
    """grad_norm from optimizer.step() is the hand norm of the gradient before clipping;
    the update is Adam's first step on the gradient scaled to clip_grad (dp2: the
    distributed optimizer's sharded norm and update)."""
    out = tmp_path / "clip.json"
    spawn(_clip, parse_layout(layout)[1], layout, str(out))
    r = json.loads(out.read_text())
    for clip in ("1.0", "0.0"):
        assert r[clip]["grad_norm"] == pytest.approx(NORM, rel=1e-5)
        assert r[clip]["err"] < 1e-7, r
    # and the two differ: unclipped, the largest entry moves ~9x further (10x but for eps)
    assert r["0.0"]["moved"] > 5 * r["1.0"]["moved"]


def _trainer(ckpt: str, out: str, phase: str) -> None:
    from moerl.algo.config import AlgoConfig
    from moerl.algo.correction_config import CorrectionConfig
    from moerl.config.parallel import ParallelConfig
    from moerl.config.trainer import TrainerConfig
    from moerl.models.tiny import tiny_config
    from moerl.trainer.trainer import Trainer

    cfg = TrainerConfig(
        lr=1e-3, min_lr=1e-4, lr_schedule="cosine", lr_warmup_steps=2, train_iters=4,
        minibatches=2, weight_decay=0.1, checkpoint_dir=ckpt, resume=phase != "straight",
    )  # fmt: skip
    if phase == "new_lr":
        cfg.lr = 2e-3
    trainer = Trainer(
        tiny_config("deepseek_moe"), ParallelConfig(), cfg, AlgoConfig(), CorrectionConfig()
    )
    lrs = []
    steps = {"straight": 3, "resumed": 8 - 3, "new_lr": 1}[phase]
    for _ in range(steps):  # what the step loop does after each optimizer.step()
        lrs.append(trainer.current_lr())
        trainer.scheduler.step(1)
    if phase == "straight":
        trainer.save()
        lrs += [trainer.current_lr()]  # the next step's lr: the resumed run's first
    record = {"lrs": lrs, "num_steps": trainer.scheduler.num_steps}
    Path(out).write_text(json.dumps(record))


@pytest.mark.slow  # out of the default run (the suite's 20-minute budget)
def test_trainer_resumes_the_schedule(tmp_path) -> None:
    """Save after 3 optimizer steps (warmup 2 of a cosine over 4 × 2 steps); a resumed
    Trainer's lr at each later step is the uninterrupted schedule's."""
    from moerl.config.trainer import TrainerConfig
    from moerl.trainer.schedule import build_scheduler, current_lr

    ckpt = str(tmp_path / "ckpt")
    for phase in ("straight", "resumed", "new_lr"):
        spawn(_trainer, 1, ckpt, str(tmp_path / f"{phase}.json"), phase)
    straight, resumed, new_lr = (
        json.loads((tmp_path / f"{p}.json").read_text()) for p in ("straight", "resumed", "new_lr")
    )

    def reference(lr: float) -> list[float]:
        cfg = TrainerConfig(
            lr=lr, min_lr=1e-4, lr_schedule="cosine", lr_warmup_steps=2, train_iters=4,
            minibatches=2,
        )  # fmt: skip
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr)
        sched, out = build_scheduler(opt, cfg), []
        for _ in range(8):
            out.append(current_lr(opt))
            sched.step(1)
        return out

    want = reference(1e-3)
    assert straight["lrs"] == pytest.approx(want[:4], rel=1e-12)
    assert resumed["lrs"] == pytest.approx(want[3:], rel=1e-12)
    assert resumed["num_steps"] == 8
    # a resume with trainer.lr=2e-3 continues at step 3 on the new peak
    assert new_lr["lrs"] == pytest.approx(reference(2e-3)[3:4], rel=1e-12)


def _cpu_adams(layout: str, out: str) -> None:
    from moerl.trainer.wrap import OptimConfig, build_optimizer

    ddp, params, distributed = _tiny_ddp(layout)
    start = [p.detach().clone() for p in params]
    record: dict = {}
    finals: dict[str, list[torch.Tensor]] = {}
    for impl in ("for_loop", "foreach", "fused"):
        with torch.no_grad():
            for p, s in zip(params, start):
                p.copy_(s)
        optimizer = build_optimizer(
            ddp,
            OptimConfig(lr=1e-2, weight_decay=0.01, adam_eps=1e-6, cpu_adam=impl,
                        use_distributed_optimizer=distributed),
        )  # fmt: skip
        groups = [g for o in optimizer.chained_optimizers for g in o.optimizer.param_groups]
        record[impl] = {"flags": sorted({(bool(g["fused"]), bool(g["foreach"])) for g in groups})}
        gen = torch.Generator().manual_seed(3)
        for _ in range(3):
            for c in ddp:
                c.zero_grad_buffer()
            optimizer.zero_grad()
            for p in params:
                p.main_grad.copy_(torch.randn(p.shape, generator=gen))
            ok, _, _ = optimizer.step()
            assert ok
        finals[impl] = [p.detach().clone() for p in params]
    ref = finals["for_loop"]
    for impl in ("foreach", "fused"):
        record[impl]["bitwise"] = all(torch.equal(a, b) for a, b in zip(finals[impl], ref))
        record[impl]["max_err"] = max(float((a - b).abs().max()) for a, b in zip(finals[impl], ref))
    record["moved"] = max(float((a - b).abs().max()) for a, b in zip(ref, start))
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(record))


@pytest.mark.parametrize("layout", ["single", "dp2"])
def test_cpu_adam_implementations_reach_torch_and_agree(layout: str, tmp_path) -> None:
    """trainer.cpu_adam sets the torch AdamW under megatron-core's optimizer (also the
    distributed one's shards): 'foreach' steps bitwise as the loop, 'fused' within a few
    ulps of it, after three steps that move the weights."""
    out = tmp_path / "adams.json"
    spawn(_cpu_adams, parse_layout(layout)[1], layout, str(out))
    r = json.loads(out.read_text())
    assert r["for_loop"]["flags"] == [[False, False]]
    assert r["foreach"]["flags"] == [[False, True]]
    assert r["fused"]["flags"] == [[True, False]]
    assert r["foreach"]["bitwise"], r
    assert r["fused"]["max_err"] < 1e-6 < r["moved"], r


def test_an_unknown_cpu_adam_is_refused():
    from moerl.trainer.wrap import choose_cpu_adam

    with pytest.raises(ValueError, match="cpu_adam='apex'"):
        choose_cpu_adam(object(), "apex")
