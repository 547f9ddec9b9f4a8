"""The files of a trainer checkpoint on disk: which must be there, whether they are whole,
which checkpoint a resume loads, and pruning old ones.

Checked without loading any tensor (sizes against the indexes the writers left), so the
launcher can run it before a rank starts: a truncated ``*.distcp`` (megatron-core's
torch_dist shards, indexed by ``.metadata``), ``optim_rank*.pt`` / ``rng_rank*.pt`` /
``common.pt`` (torch zip archives, their index at the end) or ``progress.json`` is named
with its path and the fix, instead of failing later inside a collective load.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import zipfile
from pathlib import Path
from typing import Any

from moerl.convert.hf_io import CheckpointError

LATEST = "latest"
PROGRESS = "progress.json"
PREFIX = "step_"
_DELETING = ".deleting_"

log = logging.getLogger(__name__)


def _fix(path: Path) -> str:
    return (
        f"the checkpoint {path} is corrupt: restore the file, or delete {path} "
        "(trainer.resume=true then falls back to the newest older checkpoint)"
    )


def _read_json(file: Path, ckpt: Path) -> Any:
    if not file.is_file():
        raise CheckpointError(f"{file} is missing: {_fix(ckpt)}")
    try:
        return json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        size = file.stat().st_size
        raise CheckpointError(
            f"{file} is not valid JSON ({err}; {size} bytes): {_fix(ckpt)}"
        ) from None


def read_progress(path: Path) -> dict[str, Any]:
    """The checkpoint's ``progress.json`` (step, version, layout, ...), checked."""
    progress = _read_json(path / PROGRESS, path)
    if not isinstance(progress, dict) or not isinstance(progress.get("step"), int):
        raise CheckpointError(f"{path / PROGRESS} holds no step number: {_fix(path)}")
    return progress


def _check_zip(file: Path, ckpt: Path) -> None:
    """A ``torch.save`` file is a zip archive whose index sits at its end: a truncated
    file has none (and an entry may not run past the end)."""
    if not file.is_file():
        raise CheckpointError(f"{file} is missing: {_fix(ckpt)}")
    size = file.stat().st_size
    try:
        with zipfile.ZipFile(file) as archive:
            for info in archive.infolist():
                if info.header_offset + info.compress_size > size:
                    raise zipfile.BadZipFile(f"entry {info.filename} runs past the end")
    except (zipfile.BadZipFile, OSError) as err:
        raise CheckpointError(
            f"{file} is truncated or corrupt ({err}; {size} bytes): {_fix(ckpt)}"
        ) from None


def _check_shards(path: Path) -> None:
    """Every ``*.distcp`` shard holds the bytes its ``.metadata`` index points at."""
    from torch.distributed.checkpoint import FileSystemReader

    index = path / ".metadata"
    if not index.is_file():
        raise CheckpointError(f"{index} is missing: {_fix(path)}")
    try:
        storage = FileSystemReader(str(path)).read_metadata().storage_data
    except Exception as err:  # an unreadable pickle raises any of several types
        raise CheckpointError(
            f"{index} cannot be read ({type(err).__name__}: {err}): {_fix(path)}"
        ) from None
    need: dict[str, int] = {}
    for item in storage.values():
        end = item.offset + item.length
        need[item.relative_path] = max(need.get(item.relative_path, 0), end)
    for name, end in sorted(need.items()):
        shard = path / name
        if not shard.is_file():
            raise CheckpointError(f"{shard} is missing: {_fix(path)}")
        size = shard.stat().st_size
        if size < end:
            raise CheckpointError(
                f"{shard} is truncated: {size} bytes, its index needs {end}: {_fix(path)}"
            )


def verify(path: str | Path) -> dict[str, Any]:
    """Check that the checkpoint ``path`` is complete and whole; returns its progress
    record. Raises CheckpointError naming the first bad file and the fix."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    progress = read_progress(path)
    _read_json(path / "metadata.json", path)  # megatron-core's backend record
    _check_shards(path)
    if (path / "common.pt").exists():
        _check_zip(path / "common.pt", path)
    world = int((progress.get("layout") or {}).get("world", 1))
    for rank in range(world):
        _check_zip(path / f"rng_rank{rank:05d}.pt", path)
        if progress.get("optimizer_state"):
            _check_zip(path / f"optim_rank{rank:05d}.pt", path)
    return progress


def step_of(path: Path) -> int:
    """The step number in a ``step_000042`` folder name (-1 for another name)."""
    digits = path.name[len(PREFIX) :]
    return int(digits) if path.name.startswith(PREFIX) and digits.isdigit() else -1


def checkpoints(root: str | Path) -> list[Path]:
    """The ``step_*`` folders under ``root``, newest step first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and step_of(p) >= 0]
    return sorted(found, key=step_of, reverse=True)


def pointed(root: str | Path) -> Path | None:
    """The checkpoint ``root/latest`` names (None without a pointer)."""
    pointer = Path(root) / LATEST
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    return Path(root) / name if name else None


def newest_loadable(root: str | Path) -> Path:
    """The checkpoint a resume loads: the one ``latest`` names, else the newest step,
    skipping (with a warning naming each) any that is incomplete or corrupt. Raises
    CheckpointError if ``root`` holds none that is whole."""
    root = Path(root)
    candidates = checkpoints(root)
    target = pointed(root)
    if target is not None and target in candidates:
        candidates.remove(target)
        candidates.insert(0, target)
    if not candidates:
        what = "does not exist" if not root.exists() else "holds no step_* checkpoint"
        raise CheckpointError(
            f"trainer.resume=true but trainer.checkpoint_dir={root} {what}: start without "
            "trainer.resume, or point trainer.checkpoint_dir at the folder a run saved into"
        )
    problems = []
    for path in candidates:
        try:
            verify(path)
        except CheckpointError as err:
            problems.append(str(err))
            continue
        for problem in problems:
            log.warning("skipping a checkpoint on resume: %s", problem)
        return path
    raise CheckpointError(
        f"no loadable checkpoint under {root}; every one is incomplete or corrupt:\n  "
        + "\n  ".join(problems)
        + "\nrestore the named files, or start without trainer.resume"
    )


def prune(root: str | Path, keep: int) -> list[Path]:
    """Delete all but the ``keep`` newest checkpoints under ``root`` (0 = keep all), never
    the one ``latest`` names; returns the deleted paths. Each is renamed away before it is
    deleted, so a crash mid-delete leaves no half checkpoint behind for a resume."""
    root = Path(root)
    for stale in root.glob(f"{_DELETING}*"):  # a previous prune that crashed
        shutil.rmtree(stale, ignore_errors=True)
    if keep <= 0:
        return []
    current = pointed(root)
    doomed = [p for p in checkpoints(root)[keep:] if p != current]
    for path in doomed:
        trash = root / f"{_DELETING}{path.name}"
        os.replace(path, trash)
        shutil.rmtree(trash)
    return doomed
