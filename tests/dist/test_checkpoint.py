"""Checkpoint and resume: model, optimizer, RNG and progress continue bit for bit; a
crash mid-save leaves the previous checkpoint as the latest."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from moerl.parallel import parse_layout, spawn
from moerl.parallel.parity import ParityConfig, _forward_step, _microbatches


def _train(layout: str, root: str, out: str, seed: int, resume: bool) -> None:
    from moerl.models.gpt import build_model
    from moerl.parallel.full_state import gather_full
    from moerl.parallel.state import initialize_model_parallel
    from moerl.trainer import checkpoint
    from moerl.trainer.step import train_step
    from moerl.trainer.wrap import OptimConfig, attach_schedule_hooks, build_optimizer, wrap_ddp

    cfg = ParityConfig()
    model = cfg.model
    pcfg, _ = parse_layout(layout)
    initialize_model_parallel(pcfg, num_layers=4, num_attention_heads=4, num_query_groups=2, num_experts=4, seed=seed)
    ddp = wrap_ddp(build_model(model, pcfg), use_distributed_optimizer=True)
    optimizer = build_optimizer(ddp, OptimConfig(lr=1e-3, adam_eps=1e-6))
    attach_schedule_hooks(ddp, optimizer)

    def step() -> float | None:
        mbs, n = _microbatches(cfg)
        return train_step(
            ddp, optimizer, partial(_forward_step, None, {}), iter(mbs),
            num_microbatches=n, seq_length=model.seq_length, micro_batch_size=1,
        ).loss  # fmt: skip

    if resume:
        progress = checkpoint.load(root, ddp, optimizer)
        assert progress["step"] == 1 and progress["version"] == 1 and progress["cursor"] == 8
        assert progress["optimizer_state"] is True
    else:
        step()
        checkpoint.save(root, 1, ddp, {"version": 1, "cursor": 8}, optimizer)
    loss = step()
    params = gather_full([c.module for c in ddp], "param")  # after a step on restored Adam state
    losses: list = [None] * dist.get_world_size()
    dist.all_gather_object(losses, loss)
    if dist.get_rank() == 0:
        assert params is not None
        torch.save(params.tensors, Path(out) / ("resumed.pt" if resume else "straight.pt"))
        (Path(out) / ("resumed.json" if resume else "straight.json")).write_text(
            json.dumps(next(x for x in losses if x is not None))
        )


def test_resume_continues_exactly(tmp_path):
    layout = "dp2ep2"
    world = parse_layout(layout)[1]
    root = tmp_path / "ckpt"
    spawn(_train, world, layout, str(root), str(tmp_path), 1, False)
    # a crash in the middle of saving step 2: a temp dir and nothing else
    (root / ".tmp_step_000002").mkdir()
    (root / ".tmp_step_000002" / "half.distcp").write_bytes(b"\0" * 10)
    spawn(_train, world, layout, str(root), str(tmp_path), 99, True)  # other seed: weights come from the checkpoint
    straight = json.loads((tmp_path / "straight.json").read_text())
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    assert straight == resumed
    a, b = torch.load(tmp_path / "straight.pt"), torch.load(tmp_path / "resumed.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_latest_skips_incomplete(tmp_path):
    from moerl.trainer.checkpoint import latest

    good = tmp_path / "step_000001"
    good.mkdir()
    (good / "progress.json").write_text("{}")
    (good / "metadata.json").write_text("{}")
    bad = tmp_path / "step_000002"  # renamed but missing its metadata: not complete
    bad.mkdir()
    (tmp_path / "latest").write_text("step_000002")
    assert latest(tmp_path) == good
    assert latest(tmp_path / "nothing") is None


def test_optimizer_state_needs_the_saved_layout(tmp_path):
    import pytest

    root = tmp_path / "ckpt"
    spawn(_train, 4, "dp2ep2", str(root), str(tmp_path), 1, False)
    with pytest.raises(Exception, match="holds optimizer state for layout"):
        spawn(_train, 2, "ep2", str(root), str(tmp_path), 1, True)
