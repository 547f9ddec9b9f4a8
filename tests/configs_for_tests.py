"""The composed config of a command line, as the launcher's Hydra composes it
(tests/unit/test_config.py, test_algo_registry.py, test_warm_start.py)."""

from __future__ import annotations

from hydra import compose, initialize_config_module
from omegaconf import DictConfig

from moerl.config.store import register_configs


def compose_config(*overrides: str) -> DictConfig:
    """``config`` with ``overrides`` (the config store registered first)."""
    register_configs()
    with initialize_config_module(config_module="moerl.conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))
