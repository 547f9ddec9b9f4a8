"""`env=guess_number`: a multi-turn feedback game (docs/architecture.md, "Episodes").

    obs     guess a number from 1 to 20:
    action  10                      the first integer of the turn is the guess
    obs     higher                  the secret is higher; reward closer_reward when the
                                    guess is in range and closer than every earlier one
    action  15
    obs     lower
    action  13                      right: reward discount**turn, the episode ends

A turn without a number is the observation `error: no number ` (tool_error) and counts as
a turn. The episode also ends, unwon, after `max_turns` guesses. The secret is
numpy's default_rng([seed, prompt_id]) in [lo, hi], so every sample of a prompt's group
plays the same game and a rerun replays it; the prompt's text is not used.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from moerl.config.env import GuessNumberEnvConfig
from moerl.envs.base import Action, Observation, Step
from moerl.envs.registry import ENVS
from moerl.envs.scoring import first_int
from moerl.tasks.base import Prompt


def secret_of(prompt_id: int, cfg: GuessNumberEnvConfig) -> int:
    """The secret of a prompt: the same for the same (seed, prompt_id, lo, hi)."""
    rng = np.random.default_rng([cfg.seed, prompt_id])
    return int(rng.integers(cfg.lo, cfg.hi + 1))


class GuessNumberEnv:
    """One game: a secret, the guesses so far and the closest of them."""

    def __init__(self, prompt: Prompt, cfg: GuessNumberEnvConfig) -> None:
        self.cfg = cfg
        self.secret = secret_of(prompt.prompt_id, cfg)
        self.turns = 0
        self.best = cfg.hi - cfg.lo + 1  # any guess in range is closer than no guess

    async def reset(self) -> Observation:
        return Observation(text=f"guess a number from {self.cfg.lo} to {self.cfg.hi}: ")

    async def step(self, action: Action) -> Step:
        cfg = self.cfg
        turn, self.turns = self.turns, self.turns + 1
        out_of_turns = self.turns >= cfg.max_turns
        guess = first_int(action.text)
        if guess is None:
            info = {"tool_call": True, "tool_error": True, "secret": self.secret}
            return self._next("error: no number ", 0.0, out_of_turns, info)
        if guess == self.secret:
            info = {"tool_call": True, "correct": True}
            return Step(reward=cfg.discount**turn, done=True, info=info)
        distance = abs(guess - self.secret)
        closer = cfg.lo <= guess <= cfg.hi and distance < self.best
        if closer:
            self.best = distance
        text = "higher " if self.secret > guess else "lower "
        reward = cfg.closer_reward if closer else 0.0
        return self._next(text, reward, out_of_turns, {"tool_call": True, "secret": self.secret})

    def _next(self, text: str, reward: float, done: bool, info: dict[str, Any]) -> Step:
        if done:
            return Step(reward=reward, done=True, info={**info, "correct": False})
        return Step(observation=Observation(text=text), reward=reward, info=info)


@ENVS.register("guess_number", GuessNumberEnvConfig)
def guess_number(prompt: Prompt, cfg: GuessNumberEnvConfig) -> GuessNumberEnv:
    return GuessNumberEnv(prompt, cfg)
