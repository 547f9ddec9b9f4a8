"""Checkpoint and resume: model, optimizer, RNG and progress continue bit for bit; a
crash mid-save leaves the previous checkpoint as the latest; a truncated checkpoint is
skipped on resume and old ones are pruned."""

from __future__ import annotations

import json
import os
import re
import shutil
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from moerl.parallel import parse_layout, spawn
from moerl.checks.parity import ParityConfig, _forward_step, _microbatches


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
    initialize_model_parallel(
        pcfg, num_layers=4, num_attention_heads=4, num_query_groups=2, num_experts=4, seed=seed
    )
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
    spawn(
        _train, world, layout, str(root), str(tmp_path), 99, True
    )  # other seed: weights come from the checkpoint
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


@pytest.mark.slow  # out of the default run (the suite's 20-minute budget)
def test_optimizer_state_needs_the_saved_layout(tmp_path):
    root = tmp_path / "ckpt"
    spawn(_train, 4, "dp2ep2", str(root), str(tmp_path), 1, False)
    with pytest.raises(Exception, match="holds optimizer state for layout"):
        spawn(_train, 2, "ep2", str(root), str(tmp_path), 1, True)


def _trainer_checkpoints(root: str, out: str, resume: bool) -> None:
    """Without resume: publish versions 1..3 keeping 2. With resume: record the version
    the trainer resumed at and the warnings it printed."""
    import logging

    from moerl.config import MoerlConfig
    from moerl.trainer.trainer import Trainer

    cfg = MoerlConfig()
    cfg.trainer.checkpoint_dir, cfg.trainer.resume, cfg.trainer.keep_checkpoints = root, resume, 2
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("moerl").addHandler(handler)
    trainer = Trainer(cfg.model, cfg.parallel, cfg.trainer, cfg.algo, cfg.correction)
    if resume:
        result = {"version": trainer.version, "cursor": trainer.progress["cursor"]}
        (Path(out) / "resumed.json").write_text(json.dumps({**result, "warnings": warnings}))
        return
    for version in (1, 2, 3):
        trainer.version = version  # what a step publishes; the weights need not change
        trainer.save(cursor=10 * version)


@pytest.mark.slow
def test_resume_skips_a_truncated_checkpoint_and_pruning_keeps_two(tmp_path):
    from moerl.convert.hf_io import CheckpointError
    from moerl.trainer.checkpoint_files import verify

    root = tmp_path / "ckpt"
    spawn(_trainer_checkpoints, 1, str(root), str(tmp_path), False)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000002", "step_000003"]
    assert (root / "latest").read_text() == "step_000003"
    newest = root / "step_000003"
    # every kind of file a truncation can hit is named, with the fix
    for name in ("__0_0.distcp", "optim_rank00000.pt", "progress.json"):
        copy = tmp_path / f"copy-{name}"
        shutil.copytree(newest, copy)
        os.truncate(copy / name, (copy / name).stat().st_size // 2)
        with pytest.raises(CheckpointError, match=re.escape(str(copy / name))):
            verify(copy)
    shard = max(newest.glob("*.distcp"), key=lambda p: p.stat().st_size)
    os.truncate(shard, shard.stat().st_size - 100)
    spawn(_trainer_checkpoints, 1, str(root), str(tmp_path), True)
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    assert (resumed["version"], resumed["cursor"]) == (2, 20)
    assert len(resumed["warnings"]) == 1 and str(shard) in resumed["warnings"][0]
