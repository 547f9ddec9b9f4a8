"""``engine.device``: validated at start-up, and passed to every embedded engine (the
run's, the evaluator's through ``engine_flags``, the reward model's) as ``--device``."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_module
from omegaconf import DictConfig

from moerl.config.store import register_configs
from moerl.validate import validate_config


@pytest.fixture(autouse=True, scope="module")
def _registered() -> None:
    register_configs()


def _compose(*overrides: str) -> DictConfig:
    with initialize_config_module(config_module="moerl.conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:1"])
def test_engine_device_reaches_the_engine_flags(device: str) -> None:
    from moerl.engine.__main__ import parse_args
    from moerl.launch import engine_flags

    cfg = validate_config(_compose(f"engine.device={device}"), world_size=1)
    flags = engine_flags(cfg.engine)
    assert flags[flags.index("--device") + 1] == device
    if device in ("auto", "cpu"):  # parse_args checks the device exists on this machine
        assert parse_args(["--model-path", "m", *flags]).device == device


def test_engine_device_defaults_to_auto() -> None:
    assert _compose().engine.device == "auto"


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "cpu:0"])
def test_a_bad_engine_device_names_the_key_and_the_choices(device: str) -> None:
    with pytest.raises(ValueError, match=rf"engine.device='{device}' .*'auto', 'cpu', 'cuda'"):
        validate_config(_compose(f"engine.device={device}"), world_size=1)
