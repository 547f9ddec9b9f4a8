"""The env slot's config: options validated with the field named, the shipped conf/env
options composing and validating, `env=custom` through `_target_`, and clear errors."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from moerl.config.env import (
    ENV_OPTIONS,
    CalculatorEnvConfig,
    CustomEnvConfig,
    EnvConfig,
    GuessNumberEnvConfig,
    TwoAgentEnvConfig,
)
from moerl.config.store import register_configs
from moerl.envs import (
    ENVS,
    Action,
    CalculatorEnv,
    GuessNumberEnv,
    TwoAgentEnv,
    build_env_factory,
    check_env_config,
    env_config,
)
from moerl.tasks import Prompt
from moerl.validate import validate_config

CONF = Path(__file__).resolve().parents[2] / "conf"
PROMPT = Prompt(prompt_id=3, input_ids=np.zeros(1, np.int32), answer="19", text="12+7=")
HELPER = "envs_for_tests"


def _compose(*overrides: str) -> DictConfig:
    # The checkout's conf/ (an installed moerl.conf may be another checkout's).
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_every_registered_env_has_options_and_a_conf_file() -> None:
    assert set(ENVS.names()) == set(ENV_OPTIONS) - {"none", "custom"}
    for name in ENVS.names():
        assert ENVS.config_type(name) is ENV_OPTIONS[name]
        assert ENV_OPTIONS[name]().name == name
    shipped = sorted(p.stem for p in (CONF / "env").glob("*.yaml"))
    assert shipped == sorted(ENV_OPTIONS)


@pytest.mark.parametrize(
    "name, env_type",
    [("calculator", CalculatorEnv), ("guess_number", GuessNumberEnv), ("two_agent", TwoAgentEnv)],
)
def test_shipped_option_composes_validates_and_builds(name: str, env_type: type) -> None:
    cfg = _compose(f"env={name}", "task=arithmetic")
    validate_config(cfg, world_size=1)
    assert isinstance(env_config(cfg.env), ENV_OPTIONS[name])
    make = build_env_factory(cfg.env)
    assert make is not None and isinstance(make(PROMPT), env_type)


def test_none_builds_no_factory() -> None:
    assert build_env_factory(_compose().env) is None
    assert build_env_factory("none") is None
    assert build_env_factory(EnvConfig()) is None


@pytest.mark.parametrize(
    "spec, message",
    [
        (GuessNumberEnvConfig(max_turns=0), "env.max_turns=0 must be >= 1"),
        (EnvConfig(max_turns=0), "env.max_turns=0 must be >= 1"),
        (GuessNumberEnvConfig(lo=5, hi=4), "env.hi=4 must be >= 5"),
        (GuessNumberEnvConfig(discount=0.0), "env.discount=0.0 must be > 0.0"),
        (GuessNumberEnvConfig(closer_reward=2.0), r"env.closer_reward=2.0 must be in \[0, 1\]"),
        (CalculatorEnvConfig(max_tool_calls=-1), "env.max_tool_calls=-1 must be >= 0"),
        (CalculatorEnvConfig(partial_credit=1.5), "env.partial_credit=1.5"),
        (CalculatorEnvConfig(renderer="html"), "env.renderer='html'"),
        (TwoAgentEnvConfig(rounds=2), "env.max_turns=2 is less than 2 . env.rounds=2"),
        (TwoAgentEnvConfig(ops="+/"), "env.ops='\\+/'"),
        (TwoAgentEnvConfig(max_operand=-1), "env.max_operand=-1"),
        ({"name": "calculator", "max_tool_call": 2}, "env.max_tool_call is not an option"),
        ("chess", "env: unknown environment 'chess'; known: calculator, guess_number"),
        (CustomEnvConfig(), "env=custom needs env._target_"),
        (CustomEnvConfig(_target_="nowhere.make"), "env._target_='nowhere.make' could not be"),
        (CustomEnvConfig(_target_=f"{HELPER}.NOT_CALLABLE"), "could not be imported as a function"),
        (CustomEnvConfig(_target_=f"{HELPER}.make_echo", max_turns=0), "env.max_turns=0"),
    ],
)
def test_bad_options_name_the_field(spec: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_env_config(spec)


def test_validation_at_start_up_names_the_field() -> None:
    with pytest.raises(ValueError, match="env.max_turns=0 must be >= 1"):
        validate_config(_compose("env=calculator", "env.max_turns=0"), world_size=1)
    with pytest.raises(ValueError, match="env._target_='nowhere.make'"):
        validate_config(_compose("env=custom", "env._target_=nowhere.make"), world_size=1)


def test_custom_target_builds_an_env_with_its_options() -> None:
    cfg = _compose("env=custom", f"env._target_={HELPER}.make_echo", "+env.options.word=yo")
    validate_config(cfg, world_size=1)
    make = build_env_factory(cfg.env)
    assert make is not None
    env = make(PROMPT)

    async def play() -> tuple[str, float]:
        first = await env.reset()
        step = await env.step(Action("policy", "yo", [], "stop", 0))
        assert isinstance(step.reward, float)
        return first.text, step.reward

    assert asyncio.run(play()) == ("12+7= say yo: ", 1.0)


def test_custom_target_from_a_mapping() -> None:
    # keys that are not options of the slot are the factory's keyword arguments
    make = build_env_factory({"_target_": f"{HELPER}.make_echo", "word": "ok", "max_turns": 2})
    assert make is not None and make(PROMPT).word == "ok"  # type: ignore[attr-defined]
    cfg = env_config({"_target_": f"{HELPER}.make_echo", "word": "ok", "max_turns": 2})
    assert cfg == CustomEnvConfig(
        _target_=f"{HELPER}.make_echo", max_turns=2, options={"word": "ok"}
    )


@pytest.mark.parametrize("target", ["make_sync", "make_nothing"])
def test_custom_target_that_returns_no_env_fails_clearly(target: str) -> None:
    make = build_env_factory(CustomEnvConfig(_target_=f"{HELPER}.{target}"))
    assert make is not None
    with pytest.raises(TypeError, match="not an Env; it needs async reset"):
        make(PROMPT)


def test_options_carry_into_the_env() -> None:
    make = build_env_factory({"name": "guess_number", "lo": 40, "hi": 40})
    assert make is not None
    env = make(PROMPT)
    assert isinstance(env, GuessNumberEnv) and env.secret == 40
    # a bare base naming a built-in means its defaults, with the base's fields carried
    make = build_env_factory(EnvConfig(name="calculator", max_turns=6))
    assert make is not None
    calc_env = make(PROMPT)
    assert isinstance(calc_env, CalculatorEnv)
    assert dataclasses.replace(CalculatorEnvConfig(), max_turns=6) == calc_env.cfg
