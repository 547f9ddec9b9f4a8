"""The time stamp of the default run directory (``outputs/DATE/TIME``), the same for every
process of one launch.

Hydra's ``${now:...}`` is each process's own clock: under torchrun every rank composes
the config itself and, a second apart, two ranks made two run directories (one holding
only a log). ``${moerl_stamp:FORMAT}`` is the start time of the torchrun agent that
started this worker (its parent, read from /proc) when ``TORCHELASTIC_RUN_ID`` says
torchrun did, else this process's first call; each process keeps one value, so the
date and time parts cannot straddle midnight either.
"""

from __future__ import annotations

import os
from datetime import datetime
from pathlib import Path

from omegaconf import OmegaConf

RESOLVER = "moerl_stamp"
_STAMP: list[datetime] = []


def _parent_start(pid: int) -> datetime | None:
    """When process ``pid`` started (Linux /proc; None elsewhere or if unreadable)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22: starttime
        boot = next(
            int(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime ")
        )
        return datetime.fromtimestamp(boot + ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def launch_time() -> datetime:
    if not _STAMP:
        started = _parent_start(os.getppid()) if os.environ.get("TORCHELASTIC_RUN_ID") else None
        _STAMP.append((started or datetime.now()).replace(microsecond=0))
    return _STAMP[0]


def stamp(fmt: str) -> str:
    return launch_time().strftime(fmt)


def register_stamp_resolver() -> None:
    if not OmegaConf.has_resolver(RESOLVER):
        OmegaConf.register_new_resolver(RESOLVER, stamp)
