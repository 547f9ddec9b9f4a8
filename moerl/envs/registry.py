"""Environments by name: `env=calculator` in config, `build_env_factory(cfg.env)` in code.

A built-in registers `fn(prompt, cfg) -> Env` with its options dataclass
(moerl.config.env); the factory is called once per episode with the task's prompt. An
environment outside moerl is `env=custom env._target_=mylab.envs.make` with keyword
arguments in `env.options`: `make(prompt, **options)` must return an object satisfying
moerl.envs.base.Env.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from moerl.common.registry import Registry
from moerl.envs.base import Env
from moerl.tasks.base import Prompt

ENVS: Registry[Prompt, Env] = Registry("environment", "env")


def build_env_factory(spec: Any) -> Callable[[Prompt], Env] | None:
    """`make(prompt) -> Env` for the configured environment; None for `env=none`."""
    from omegaconf import DictConfig, OmegaConf

    cfg = OmegaConf.to_object(spec) if isinstance(spec, DictConfig) else spec
    name = cfg if isinstance(cfg, str) else getattr(cfg, "name", None)
    if isinstance(cfg, dict):
        name = cfg.get("name", "custom" if cfg.get("_target_") else None)
    if name == "none":
        return None
    return ENVS.build(cfg)
