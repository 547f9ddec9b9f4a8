"""Layout names such as ``tp2ep2`` ⇄ ``ParallelConfig`` plus the world size they need.

A name is a concatenation of ``tpN``, ``ppN``, ``epN``, ``etpN``, ``vppN`` and
``dpN`` tokens (``single`` for one process). ``dpN`` replicates the whole
model-parallel grid, experts included, N times; without it the world is the
smallest one the layout fits in: PP × lcm(TP, ETP × EP). Expert TP defaults to TP,
as in megatron-core.
"""

from __future__ import annotations

import math
import re

from moerl.config.parallel import ParallelConfig

_TOKEN = re.compile(r"(etp|vpp|tp|pp|ep|dp)(\d+)")


def parse_layout(name: str) -> tuple[ParallelConfig, int]:
    """Return the parallel config and world size for a layout name."""
    text = name.strip().lower()
    if text in ("single", "1", ""):
        return ParallelConfig(), 1
    sizes: dict[str, int] = {}
    pos = 0
    for match in _TOKEN.finditer(text):
        if match.start() != pos:
            break
        key, val = match.group(1), int(match.group(2))
        if key in sizes:
            raise ValueError(f"layout {name!r} names {key} twice")
        if val < 1:
            raise ValueError(f"layout {name!r}: {key}{val} must be at least 1")
        sizes[key] = val
        pos = match.end()
    if pos != len(text):
        raise ValueError(
            f"cannot parse layout {name!r}: use tokens tpN, ppN, epN, etpN, vppN, dpN "
            "(e.g. 'tp2ep2', 'pp2', 'etp2ep2') or 'single'"
        )
    cfg = ParallelConfig(
        tp=sizes.get("tp", 1),
        pp=sizes.get("pp", 1),
        ep=sizes.get("ep", 1),
        etp=sizes.get("etp"),
        virtual_pp=sizes.get("vpp"),
    )
    model_grid = math.lcm(cfg.tp, cfg.expert_tp * cfg.ep)
    world = cfg.pp * model_grid * sizes.get("dp", 1)
    return cfg, world
