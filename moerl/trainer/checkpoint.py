"""Trainer checkpoints: model, RNG and progress, written atomically.

A checkpoint is ``DIR/step_000042/`` holding megatron-core's distributed checkpoint of
the model (any layout can resume it), each rank's RNG states and
``progress.json`` (step, policy version, data cursor, anything the caller adds). It is
written under ``DIR/.tmp_step_000042`` and renamed into place only when every rank has
finished, then ``DIR/latest`` is replaced atomically: a crash mid-save leaves the previous
checkpoint as the latest, never a half-written one.

Optimizer state (Adam moments, step count and the fp32 master shards) is saved per rank
in ``optim_rank*.pt`` and resumes exactly in the same layout; another layout raises a
clear error. The lr scheduler's state (its optimizer-step count and settings, the same
on every rank) is a ``scheduler`` entry of ``progress.json``. (megatron-core 0.16's resharding DistributedOptimizer formats do not
round-trip without TE/apex here: the Adam moments came back empty in tests.)

On resume every file is checked first (``checkpoint_files.verify``): a corrupt or
incomplete checkpoint is skipped with a warning naming the bad file, and the newest
whole one loads. ``keep`` prunes older checkpoints once a new one is published.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moerl.convert.hf_io import CheckpointError
from moerl.trainer.checkpoint_files import (
    LATEST,
    PROGRESS,
    newest_loadable,
    prune,
    read_progress,
)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _sharded(chunks: list[Any]) -> dict:
    modules = [getattr(c, "module", c) for c in chunks]
    if len(modules) == 1:
        return {"model": modules[0].sharded_state_dict()}
    return {"model": {f"model{i}": m.sharded_state_dict() for i, m in enumerate(modules)}}


def _layout() -> dict[str, int]:
    from megatron.core import parallel_state as ps

    return {
        "world": dist.get_world_size() if dist.is_initialized() else 1,
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "ep": ps.get_expert_model_parallel_world_size(),
        "etp": ps.get_expert_tensor_parallel_world_size(),
    }


def _optimizer_state(optimizer: Any) -> list[dict[str, Any]]:
    """This rank's optimizer state: each (chained) torch optimizer's state dict and its
    parameters' values (the fp32 master shards the distributed optimizer steps)."""
    out = []
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = sub.optimizer
        out.append(
            {
                "state": inner.state_dict(),
                "main": [[p.detach().clone() for p in g["params"]] for g in inner.param_groups],
            }
        )
    return out


@torch.no_grad()
def _load_optimizer_state(optimizer: Any, saved: list[dict[str, Any]]) -> None:
    subs = list(getattr(optimizer, "chained_optimizers", [optimizer]))
    if len(subs) != len(saved):
        raise ValueError(f"checkpoint holds {len(saved)} optimizers, the trainer has {len(subs)}")
    for sub, state in zip(subs, saved):
        sub.optimizer.load_state_dict(state["state"])
        for group, values in zip(sub.optimizer.param_groups, state["main"]):
            for p, v in zip(group["params"], values):
                p.copy_(v)


def _rng_state() -> dict[str, Any]:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    return {"torch": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def save(
    root: str | Path,
    step: int,
    chunks: list[Any],
    progress: dict[str, Any],
    optimizer: Any | None = None,
    extra: Callable[[Path], None] | None = None,
    scheduler: Any | None = None,
    keep: int = 0,
) -> Path:
    """Save step ``step`` under ``root`` on every rank; returns the final directory.
    ``extra(tmp_dir)`` runs on rank 0 inside the checkpoint before it is published, for
    state outside the model's sharded state dict (LoRA adapters). ``scheduler``: an
    OptimizerParamScheduler whose state joins the progress record. ``keep`` > 0: once
    published, delete all but the ``keep`` newest checkpoints (never the latest)."""
    from megatron.core import dist_checkpointing

    root = Path(root)
    name = f"step_{step:06d}"
    tmp, final = root / f".tmp_{name}", root / name
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    _barrier()
    dist_checkpointing.save(_sharded(chunks), str(tmp))
    torch.save(_rng_state(), tmp / f"rng_rank{_rank():05d}.pt")
    if optimizer is not None:
        torch.save(_optimizer_state(optimizer), tmp / f"optim_rank{_rank():05d}.pt")
    _barrier()
    if _rank() == 0:
        if extra is not None:
            extra(tmp)
        record = {
            "step": step,
            "optimizer_state": optimizer is not None,
            "layout": _layout(),
            **progress,
        }
        if scheduler is not None:
            record["scheduler"] = scheduler.state_dict()
        (tmp / PROGRESS).write_text(json.dumps(record, indent=2))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer = root / f".{LATEST}.tmp"
        pointer.write_text(name)
        os.replace(pointer, root / LATEST)
        prune(root, keep)
    _barrier()
    return final


def latest(root: str | Path) -> Path | None:
    """The newest complete checkpoint under ``root`` (None if there is none)."""
    root = Path(root)
    pointer = root / LATEST
    candidates = []
    if pointer.is_file():
        candidates.append(root / pointer.read_text().strip())
    candidates += sorted(root.glob("step_*"), reverse=True)
    for path in candidates:
        if (path / PROGRESS).is_file() and (path / "metadata.json").is_file():
            return path
    return None


def resume_point(root: str | Path) -> Path:
    """The checkpoint under ``root`` a resume loads (``newest_loadable``), decided on rank 0
    and shared, so every rank loads the same one and warnings print once. Raises the same
    CheckpointError on every rank if there is none."""
    choice: list[Any] = [None]
    if _rank() == 0:
        try:
            choice = [str(newest_loadable(root))]
        except CheckpointError as err:
            choice = [err]
    if dist.is_initialized():
        dist.broadcast_object_list(choice, src=0)
    if isinstance(choice[0], Exception):
        raise CheckpointError(str(choice[0]))
    return Path(choice[0])


def _torch_load(file: Path) -> Any:
    try:
        return torch.load(file, weights_only=True)
    except Exception as err:  # a damaged archive fails in zip, pickle or storage code
        raise CheckpointError(
            f"{file} cannot be loaded ({type(err).__name__}: {err}): the checkpoint "
            f"{file.parent} is corrupt; restore the file, or delete {file.parent} to resume "
            "from the previous checkpoint"
        ) from err


def load(
    root: str | Path,
    chunks: list[Any],
    optimizer: Any | None = None,
    scheduler: Any | None = None,
) -> dict[str, Any]:
    """Restore a checkpoint into ``chunks`` (any layout), and into ``optimizer`` and
    ``scheduler`` when given; returns its progress record. ``root`` is one checkpoint
    (``step_*``, as ``resume_point`` returns) or a folder of them (its resume point).
    Raises CheckpointError naming a missing or corrupt file and the fix."""
    from megatron.core import dist_checkpointing

    path = Path(root)
    if not (path / PROGRESS).is_file():
        path = resume_point(path)
    progress = read_progress(path)
    try:
        state = dist_checkpointing.load(_sharded(chunks), str(path))
    except Exception as err:  # checked files can still hold bad bytes
        raise CheckpointError(
            f"the model in {path} cannot be loaded ({type(err).__name__}: {err}): the "
            f"checkpoint is corrupt or from another model; delete {path} to resume from the "
            "previous checkpoint"
        ) from err
    modules = [getattr(c, "module", c) for c in chunks]
    if len(modules) == 1:
        modules[0].load_state_dict(state["model"], strict=False)
    else:
        for i, m in enumerate(modules):
            m.load_state_dict(state["model"][f"model{i}"], strict=False)
    if optimizer is not None:
        if not progress.get("optimizer_state"):
            raise ValueError(
                f"{path} has no optimizer state; resume with a fresh optimizer (optimizer=None)"
            )
        if progress.get("layout") != _layout():
            raise ValueError(
                f"{path} holds optimizer state for layout {progress.get('layout')}, this run is "
                f"{_layout()}: resume in the saved layout, or without the optimizer state"
            )
        _load_optimizer_state(optimizer, _torch_load(path / f"optim_rank{_rank():05d}.pt"))
    if scheduler is not None:
        from moerl.trainer.schedule import load_scheduler_state

        if "scheduler" not in progress:
            raise ValueError(
                f"{path}/{PROGRESS} has no lr scheduler state (saved before schedules "
                "were checkpointed): the schedule cannot continue; start a fresh run"
            )
        load_scheduler_state(scheduler, progress["scheduler"])  # after the optimizer's groups
    rng = path / f"rng_rank{_rank():05d}.pt"
    if rng.is_file():  # same world size: restore this rank's streams exactly
        _set_rng_state(_torch_load(rng))
    return progress
