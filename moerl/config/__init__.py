"""Config schemas for every Hydra config group (the start-up validation pass that checks
them against the registries is `moerl.validate`).

Importing this package is cheap (dataclasses only); Hydra is imported by
`moerl.config.store` and `moerl.validate`.
"""

from moerl.config.engine import EngineConfig
from moerl.config.launcher import LauncherConfig
from moerl.config.model import ModelConfig
from moerl.config.parallel import ParallelConfig
from moerl.config.schema import MoerlConfig
from moerl.config.trainer import TrainerConfig

__all__ = [
    "EngineConfig",
    "LauncherConfig",
    "ModelConfig",
    "MoerlConfig",
    "ParallelConfig",
    "TrainerConfig",
]
