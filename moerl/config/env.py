"""Options of the environment slot (group `env`, conf/env/): multi-turn, tool-using and
multi-agent episodes (moerl.envs; docs/architecture.md, "Episodes").

`env=none` (the default) keeps rollouts single-turn: one prompt, one completion. Any other
option makes every rollout an episode driven by the environment it names, with prompts
still read from the configured task (each episode's `make(prompt)` gets one). A user's own
environment: `env=custom env._target_=mylab.envs.make` (`make(prompt, **options) -> Env`).
Torch-free, like the other config modules.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from moerl.common.checks import at_least, one_of

if TYPE_CHECKING:
    from hydra.core.config_store import ConfigStore

RENDERERS = ("raw", "chat")


@dataclass
class EnvConfig:
    """The environment slot: what drives an episode and how long it may run."""

    name: str = "none"
    """Environment registered in moerl.envs.ENVS; `none` = single-turn rollouts."""
    max_turns: int = 8
    """Actions per episode, all roles counted; the episode ends (finish 'turns') after."""
    max_episode_tokens: int = 0
    """Longest token stream of a role (observations and actions); 0 = the engine's
    context length (engine.context_length). A turn gets what is left of it, at most
    rollout.max_new_tokens."""
    renderer: str = "raw"
    """How observation text becomes tokens: raw = the tokenizer's encoding of the text
    alone; chat = a user turn of the tokenizer's chat template (with the end of the
    previous assistant turn and the next generation prompt)."""

    def validate(self, key: str) -> None:
        """Raise ValueError naming `key.field` for an out-of-range option."""
        at_least(f"{key}.max_turns", self.max_turns, 1)
        at_least(f"{key}.max_episode_tokens", self.max_episode_tokens, 0)
        one_of(f"{key}.renderer", self.renderer, RENDERERS)

    @property
    def enabled(self) -> bool:
        return self.name != "none"


@dataclass
class CustomEnvConfig(EnvConfig):
    """An environment outside moerl: `make(prompt, **options) -> Env`."""

    name: str = "custom"
    """Marks the escape hatch; the factory is found through `_target_`."""
    _target_: str = ""
    """Import path of the factory, e.g. 'mylab.envs.make'."""
    options: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments passed to the factory (`+env.options.level=3`)."""


def _unit(key: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{key}={value!r} must be in [0, 1]")


@dataclass
class CalculatorEnvConfig(EnvConfig):
    """Tool use: the task's arithmetic prompt (task=arithmetic), a `calc` tool called as
    `call:calc(12+7)`, and a final answer (`answer: 19` or `19`) that ends the episode."""

    name: str = "calculator"
    """Registered name of this environment."""
    max_turns: int = 4
    """Actions per episode: tool calls and the final answer."""
    max_tool_calls: int = 3
    """Tool calls an episode may make; a call past it is an `error: ...` observation."""
    preamble: str = ""
    """Text put before the prompt in the first observation (tiny-tokenizer characters for
    tiny models), e.g. 'use call:calc(...) then answer: '."""
    partial_credit: float = 0.5
    """Weight of the `shaped` credit (digits, right digits, stopping; moerl.tasks.rewards)
    a wrong final answer earns; a right one earns 1. 0 = exact answers only."""
    tool_credit: float = 0.1
    """Reward of each well-formed call that evaluates (a signal before answers are right);
    at most max_tool_calls of them pay."""

    def validate(self, key: str) -> None:
        super().validate(key)
        at_least(f"{key}.max_tool_calls", self.max_tool_calls, 0)
        _unit(f"{key}.partial_credit", self.partial_credit)
        _unit(f"{key}.tool_credit", self.tool_credit)


@dataclass
class GuessNumberEnvConfig(EnvConfig):
    """A feedback game: guess a secret integer in [lo, hi], told `higher` or `lower`."""

    name: str = "guess_number"
    """Registered name of this environment."""
    lo: int = 1
    """Smallest secret (inclusive)."""
    hi: int = 20
    """Largest secret (inclusive)."""
    seed: int = 0
    """The secret of a prompt is drawn from numpy's default_rng([seed, prompt_id])."""
    discount: float = 1.0
    """A right guess at turn t (0-based) earns discount**t."""
    closer_reward: float = 0.1
    """Reward of a wrong guess within [lo, hi] that is closer to the secret than every
    earlier guess (per-turn credit); 0 = only the right guess pays."""

    def validate(self, key: str) -> None:
        super().validate(key)
        at_least(f"{key}.hi", self.hi, self.lo)
        at_least(f"{key}.discount", self.discount, 0.0, strict=True)
        _unit(f"{key}.discount", self.discount)
        _unit(f"{key}.closer_reward", self.closer_reward)


@dataclass
class TwoAgentEnvConfig(EnvConfig):
    """Proposer and solver on one policy: the proposer writes `a+b`, the solver answers."""

    name: str = "two_agent"
    """Registered name of this environment."""
    max_turns: int = 2
    """Actions per episode: two per round (proposal, answer); at least 2 * rounds."""
    rounds: int = 1
    """Proposal/answer rounds per episode."""
    ops: str = "+"
    """Operators a proposal may use, any of '+', '-', '*'."""
    max_operand: int = 99
    """Largest operand of a valid proposal (operands are integers >= 0)."""
    valid_reward: float = 0.5
    """The proposer's reward for a valid proposal; it gets the rest of 1 when the solver
    answers it right."""
    partial_credit: float = 0.5
    """Weight of the `shaped` credit a wrong answer earns the solver; a right one earns 1."""

    def validate(self, key: str) -> None:
        super().validate(key)
        at_least(f"{key}.rounds", self.rounds, 1)
        if self.max_turns < 2 * self.rounds:
            raise ValueError(
                f"{key}.max_turns={self.max_turns} is less than 2 * {key}.rounds="
                f"{self.rounds} (a proposal and an answer per round); set "
                f"{key}.max_turns={2 * self.rounds}"
            )
        at_least(f"{key}.max_operand", self.max_operand, 0)
        bad = sorted(set(self.ops) - set("+-*"))
        if not self.ops or bad:
            raise ValueError(f"{key}.ops={self.ops!r} must be a non-empty string of '+-*'")
        _unit(f"{key}.valid_reward", self.valid_reward)
        _unit(f"{key}.partial_credit", self.partial_credit)


ENV_OPTIONS: dict[str, type[EnvConfig]] = {
    "none": EnvConfig,
    "custom": CustomEnvConfig,
    "calculator": CalculatorEnvConfig,
    "guess_number": GuessNumberEnvConfig,
    "two_agent": TwoAgentEnvConfig,
}
"""Options by name; the environments register under the same names in moerl.envs.ENVS."""


def register_env_configs(cs: ConfigStore) -> None:
    """Store one schema per environment (`base_NAME`) in the group `env`."""
    for name, schema in ENV_OPTIONS.items():
        cs.store(group="env", name=f"base_{name}", node=schema, provider="moerl")
