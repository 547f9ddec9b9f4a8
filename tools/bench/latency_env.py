"""A multi-turn environment whose every step waits a long-tailed latency (tools/bench/episodes.py).

    env=custom env._target_=latency_env.make +env.options.median_s=0.2 +env.options.sigma=1.5

guess_number (moerl.envs.guess_number) with ``turns`` guesses, each step first awaiting
``asyncio.sleep(latency)``: the latency stands for a tool, a sandbox or a remote service
that holds up only its own episode. Latencies are lognormal with median ``median_s`` and
log-space spread ``sigma`` (p90 / p50 = exp(1.2816 * sigma): >= 5x for sigma >= 1.26),
drawn from numpy's default_rng([seed, prompt_id, k, turn]) where k counts the episodes of
that prompt built so far in this process, so a sync and an async run of the same recipe
and seed wait the same latencies for the same episodes.

The module sits beside the bench, not in moerl: the bench puts tools/bench on sys.path
and PYTHONPATH so the spawned trainer ranks import it by its top-level name.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter

import numpy as np

from moerl.config.env import GuessNumberEnvConfig
from moerl.envs.base import Action, Observation, Step
from moerl.envs.guess_number import GuessNumberEnv
from moerl.tasks.base import Prompt

P90_Z = 1.2815515655446004  # standard normal quantile at 0.9

_built: Counter[int] = Counter()  # episodes built per prompt id, in this process


def latency_quantiles(median_s: float, sigma: float) -> tuple[float, float]:
    """p50 and p90 of one step's latency."""
    return median_s, median_s * math.exp(P90_Z * sigma)


def draw_latencies(seed: int, prompt_id: int, k: int, turns: int, median_s: float,
                   sigma: float) -> list[float]:  # fmt: skip
    """The latencies of episode ``k`` of prompt ``prompt_id``, one per turn."""
    return [
        median_s * float(np.exp(sigma * np.random.default_rng([seed, prompt_id, k, t]).normal()))
        for t in range(turns)
    ]


class LatencyGuessNumber:
    """guess_number, each step waiting its drawn latency first."""

    def __init__(self, prompt: Prompt, latencies: list[float], game: GuessNumberEnvConfig) -> None:
        self.game = GuessNumberEnv(prompt, game)
        self.latencies = latencies
        self.turn = 0

    async def reset(self) -> Observation:
        return await self.game.reset()

    async def step(self, action: Action) -> Step:
        await asyncio.sleep(self.latencies[min(self.turn, len(self.latencies) - 1)])
        self.turn += 1
        return await self.game.step(action)


def make(prompt: Prompt, median_s: float = 0.2, sigma: float = 1.5, turns: int = 3,
         seed: int = 0) -> LatencyGuessNumber:  # fmt: skip
    """The env factory (``env._target_``); options arrive as ``env.options``."""
    if median_s < 0 or sigma < 0 or turns < 1:
        raise ValueError(
            f"latency_env: median_s={median_s}, sigma={sigma}, turns={turns}; need "
            "median_s >= 0, sigma >= 0 and turns >= 1"
        )
    k = _built[prompt.prompt_id]
    _built[prompt.prompt_id] += 1
    latencies = draw_latencies(seed, prompt.prompt_id, k, turns, median_s, sigma)
    game = GuessNumberEnvConfig(max_turns=turns, seed=seed)
    return LatencyGuessNumber(prompt, latencies, game)
