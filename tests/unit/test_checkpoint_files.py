"""Checkpoint files on disk: a truncated file is named with its path and the fix, a
resume skips corrupt checkpoints with a warning, pruning keeps N and the latest.

The checkpoints here are written in the formats the trainer writes (torch's distributed
checkpoint shards with their ``.metadata`` index, ``torch.save`` archives, JSON), without
a model; tests/dist/test_checkpoint.py does the same on real trainer checkpoints.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from moerl.convert.hf_io import CheckpointError
from moerl.trainer.checkpoint_files import newest_loadable, prune, verify

WORLD = 2

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _write(root: Path, step: int, *, point: bool = True) -> Path:
    """A checkpoint of a 2-rank run, as ``moerl.trainer.checkpoint.save`` lays it out."""
    path = root / f"step_{step:06d}"
    gen = torch.Generator().manual_seed(step)
    dcp.save({"w": torch.randn(64, 64, generator=gen)}, checkpoint_id=str(path))
    (path / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    torch.save({"step": step}, path / "common.pt")
    for rank in range(WORLD):
        torch.save({"torch": torch.get_rng_state()}, path / f"rng_rank{rank:05d}.pt")
        torch.save(
            [{"exp_avg": torch.randn(256, generator=gen)}], path / f"optim_rank{rank:05d}.pt"
        )
    layout = {"world": WORLD, "tp": 1, "pp": 1, "ep": 2, "etp": 1}
    progress = {"step": step, "optimizer_state": True, "layout": layout, "version": step}
    (path / "progress.json").write_text(json.dumps(progress, indent=2))
    if point:
        (root / "latest").write_text(path.name)
    return path


def _truncate(file: Path) -> None:
    os.truncate(file, file.stat().st_size // 2)


@pytest.mark.parametrize("name", ["__0_0.distcp", "optim_rank00001.pt", "progress.json"])
def test_truncated_file_is_named_with_the_fix(tmp_path, name) -> None:
    path = _write(tmp_path, 3)
    assert verify(path)["version"] == 3
    _truncate(path / name)
    with pytest.raises(CheckpointError) as info:
        verify(path)
    message = str(info.value)
    assert str(path / name) in message
    assert f"delete {path}" in message and "falls back" in message


def test_missing_rank_file_is_named(tmp_path) -> None:
    path = _write(tmp_path, 1)
    (path / "rng_rank00001.pt").unlink()
    with pytest.raises(CheckpointError, match="rng_rank00001.pt is missing"):
        verify(path)


def test_resume_falls_back_to_the_newest_whole_checkpoint(tmp_path, caplog) -> None:
    _write(tmp_path, 2)
    _write(tmp_path, 4)
    newest = _write(tmp_path, 6)
    _truncate(newest / "optim_rank00000.pt")
    (tmp_path / "step_000005").mkdir()  # renamed by hand, never finished
    with caplog.at_level(logging.WARNING, logger="moerl.trainer.checkpoint_files"):
        assert newest_loadable(tmp_path) == tmp_path / "step_000004"
    skipped = [r.getMessage() for r in caplog.records if r.name.startswith("moerl.")]
    assert len(skipped) == 2
    assert str(newest / "optim_rank00000.pt") in skipped[0]  # the latest is tried first
    assert str(tmp_path / "step_000005" / "progress.json") in skipped[1]


def test_resume_with_nothing_loadable_names_every_problem(tmp_path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        newest_loadable(tmp_path / "missing")
    with pytest.raises(CheckpointError, match="holds no step_"):
        newest_loadable(tmp_path)
    only = _write(tmp_path, 1)
    _truncate(only / "__0_0.distcp")
    with pytest.raises(CheckpointError) as info:
        newest_loadable(tmp_path)
    assert str(only / "__0_0.distcp") in str(info.value)
    assert "start without trainer.resume" in str(info.value)


def test_prune_keeps_the_newest_and_the_latest(tmp_path) -> None:
    for step in (1, 2, 3, 4):
        _write(tmp_path, step, point=step == 1)  # latest still names step 1
    assert prune(tmp_path, 0) == []  # 0 keeps all
    deleted = prune(tmp_path, 2)
    assert sorted(p.name for p in deleted) == ["step_000002"]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["latest", "step_000001", "step_000003", "step_000004"]
    assert newest_loadable(tmp_path) == tmp_path / "step_000001"


def test_launcher_checks_the_resume_point_before_any_rank(tmp_path, monkeypatch, capsys) -> None:
    """`trainer.resume=true` in the launcher (and its dry run): the checkpoint it would
    load, after skipping a corrupt one, and that it was saved in this run's layout."""
    from hydra import compose, initialize_config_module

    from moerl.config.store import register_configs
    from moerl.launch import preflight

    register_configs()
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    _write(tmp_path, 1)
    _truncate(_write(tmp_path, 2) / "progress.json")
    resume = [
        "model=deepseek_moe_tiny",
        "trainer.resume=true",
        f"trainer.checkpoint_dir={tmp_path}",
    ]
    with initialize_config_module(config_module="moerl.conf", version_base="1.3"):
        same = compose(
            config_name="config", overrides=[*resume, "parallel=ep2", "launcher.nproc=2"]
        )
        other = compose(config_name="config", overrides=resume)
    preflight(same)
    assert f"resuming from {tmp_path / 'step_000001'}" in capsys.readouterr().out
    with pytest.raises(ValueError) as info:
        preflight(other)
    assert "holds optimizer state for layout" in str(info.value)
    assert "'world': 2" in str(info.value) and "'world': 1" in str(info.value)
