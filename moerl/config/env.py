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


ENV_OPTIONS: dict[str, type[EnvConfig]] = {
    "none": EnvConfig,
    "custom": CustomEnvConfig,
}
"""Built-in options by name; moerl.envs adds its environments' option classes here."""


def register_env_configs(cs: ConfigStore) -> None:
    """Store one schema per environment (`base_NAME`) in the group `env`."""
    for name, schema in ENV_OPTIONS.items():
        cs.store(group="env", name=f"base_{name}", node=schema, provider="moerl")
