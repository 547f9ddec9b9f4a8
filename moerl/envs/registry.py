"""Environments by name: `env=calculator` in config, `build_env_factory(cfg.env)` in code.

A built-in registers `fn(prompt, cfg) -> Env` with its options dataclass
(moerl.config.env); the factory is called once per episode with the task's prompt. An
environment outside moerl is `env=custom env._target_=mylab.envs.make` with keyword
arguments in `env.options`: `make(prompt, **options)` must return an object satisfying
moerl.envs.base.Env. `check_env_config` is the start-up check (moerl.validate).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from moerl.common.registry import Registry
from moerl.config.env import ENV_OPTIONS, CustomEnvConfig, EnvConfig
from moerl.envs.base import Env
from moerl.tasks.base import Prompt

ENVS: Registry[Prompt, Env] = Registry("environment", "env")


def env_config(spec: Any) -> EnvConfig:
    """The options dataclass of a spec: a name, an options dataclass (what Hydra composes,
    `DictConfig` too) or a mapping with `name` or `_target_` (whose keys that are not
    options of the slot become `options`)."""
    from omegaconf import DictConfig, OmegaConf

    cfg = OmegaConf.to_object(spec) if isinstance(spec, DictConfig) else spec
    if isinstance(cfg, EnvConfig):
        return cfg
    if isinstance(cfg, str):
        cfg = {"name": cfg}
    if not isinstance(cfg, Mapping):
        raise TypeError(
            f"env: cannot build an environment from {type(cfg).__name__}; give a name, an "
            "options dataclass or a mapping with 'name' or '_target_'"
        )
    items = {str(k): v for k, v in cfg.items()}
    name = items.setdefault("name", "custom" if items.get("_target_") else "none")
    schema = ENV_OPTIONS[name] if name in ENV_OPTIONS else ENVS.config_type(name)
    known = {f.name for f in dataclasses.fields(schema)}
    unknown = sorted(set(items) - known)
    if unknown and schema is CustomEnvConfig:
        options = {k: items.pop(k) for k in unknown}
        items["options"] = {**options, **items.get("options", {})}
    elif unknown:
        raise ValueError(
            f"env.{unknown[0]} is not an option of environment {name!r}; its options are "
            + ", ".join(sorted(known - {"name"}))
        )
    return schema(**items)


def build_env_factory(spec: Any) -> Callable[[Prompt], Env] | None:
    """`make(prompt) -> Env` for the configured environment; None for `env=none`. Options
    are checked here (ValueError naming `env.FIELD`), a `_target_` is imported here, and
    what the factory returns is checked against the Env protocol at every call."""
    cfg = env_config(spec)
    if isinstance(cfg, CustomEnvConfig):
        cfg.validate(ENVS.key)
        if not cfg._target_:
            raise ValueError(
                "env=custom needs env._target_, the import path of make(prompt, **options) "
                "-> Env, e.g. env._target_=mylab.envs.make"
            )
        make = ENVS.build({"_target_": cfg._target_, "options": dict(cfg.options)})
    elif not cfg.enabled:
        cfg.validate(ENVS.key)
        return None
    else:
        make = ENVS.build(cfg)  # validates the options
    return _checked(make)


def check_env_config(spec: Any) -> None:
    """Start-up check without a prompt: the environment's name, its option ranges, a
    `_target_`'s import (a custom factory's output is checked per episode)."""
    build_env_factory(spec)


def _checked(make: Callable[[Prompt], Any]) -> Callable[[Prompt], Env]:
    def make_env(prompt: Prompt) -> Env:
        env = make(prompt)
        if not (
            isinstance(env, Env)
            and inspect.iscoroutinefunction(env.reset)
            and inspect.iscoroutinefunction(env.step)
        ):
            raise TypeError(
                f"env: the factory returned a {type(env).__name__}, not an Env; it needs "
                "async reset() -> Observation and async step(action) -> Step "
                "(moerl.envs.base.Env)"
            )
        return env

    return make_env
